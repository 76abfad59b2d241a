"""Instruments the core calls: trace events, attention capture and the KV sanitizer.

A leaf package: it imports nothing from kvlab, so ``kv``, ``attention`` and ``engine`` can call it
without the analysis that reads its records (``kvlab.analysis``) ever being imported by the core.
"""
