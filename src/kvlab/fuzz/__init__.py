"""Differential fuzzing of the whole engine against the dense oracle, with the KV sanitizer on.

Each trial draws a workload and a cache configuration from (seed, trial index), runs it on a fresh engine
through its public API, and checks every output against the dense oracle's greedy continuation, the
sanitizer for foreign reads, the KV invariants after every step and the pool at the end. A failing trial
is shrunk by hypothesis to a minimal case, saved as JSON and replayable (``kvlab fuzz --replay``).
Campaigns run serially, on a local process pool or on Ray, with identical results.

Sits beside server/probe/bench/testing: it imports the engine, experiment, kv, model and instrument
layers; only the CLI imports it.
"""

from kvlab.fuzz.campaign import CrashInjection, FuzzSettings, Reducer, TrialResult, TrialRunner
from kvlab.fuzz.case import PRECISIONS, ROW_INVARIANT, FuzzCase, FuzzConfig, FuzzRequest
from kvlab.fuzz.dispatch import ScaleOptions
from kvlab.fuzz.generate import CaseMeta, Drawn, WorkloadBounds, build_case, draw_case
from kvlab.fuzz.oracle import TIE_ATOL, Mismatch, Oracle
from kvlab.fuzz.scale import CampaignSummary, run_campaign
from kvlab.fuzz.trial import KINDS, AloneRuns, Failure, Verdict, build_engine, run_case

__all__ = [
    "KINDS",
    "PRECISIONS",
    "ROW_INVARIANT",
    "TIE_ATOL",
    "AloneRuns",
    "CampaignSummary",
    "CaseMeta",
    "CrashInjection",
    "Drawn",
    "Failure",
    "FuzzCase",
    "FuzzConfig",
    "FuzzRequest",
    "FuzzSettings",
    "Mismatch",
    "Oracle",
    "Reducer",
    "ScaleOptions",
    "TrialResult",
    "TrialRunner",
    "Verdict",
    "WorkloadBounds",
    "build_case",
    "build_engine",
    "draw_case",
    "run_campaign",
    "run_case",
]
