"""Pytest helpers: assert that an engine configuration keeps requests isolated over your passphrases.

The seed's advice: run the fixed-passphrase experiment in CI on every change to cache management::

    from kvlab.testing import assert_isolation

    def test_our_cache_settings_keep_isolation():
        assert_isolation(model="mini", cache={"block_size": 8, "prefix_granularity": "token"},
                         passphrases="tests/passphrases.yaml", trials=20)

``assert_isolation`` fails with the sanitizer's root cause (which request read which block and slot,
written by whom, at which step) when any request's output or logits differ from it run alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlab.experiment.harness import Experiment, ExperimentConfig, TrialResult
from kvlab.experiment.passphrases import (
    PassphraseGroup,
    PassphraseSet,
    default_passphrases,
    load_passphrases,
)
from kvlab.experiment.report import StrategySummary, summarize
from kvlab.experiment.strategies import BUILTIN_STRATEGIES, Strategy
from kvlab.model.loader import LoadedModel, load_model


def run_isolation_check(
    model: str | LoadedModel = "mini",
    strategy: str | Strategy = "shared-cow",
    *,
    cache: dict[str, Any] | None = None,
    scheduler: dict[str, Any] | None = None,
    passphrases: str | Path | PassphraseSet | Sequence[Sequence[str]] | None = None,
    trials: int = 20,
    concurrency: int = 2,
    seed: int = 0,
    max_tokens: int = 16,
) -> tuple[StrategySummary, list[TrialResult]]:
    """Run the passphrase experiment for one configuration and return its summary and trials.

    ``strategy`` names a built-in strategy or is a ``Strategy``; ``cache``/``scheduler`` override its knobs.
    ``passphrases`` is a YAML/JSON path, a ``PassphraseSet``, or plain groups of prompt strings.
    """
    loaded = load_model(model) if isinstance(model, str) else model
    base = BUILTIN_STRATEGIES[strategy] if isinstance(strategy, str) else strategy
    if cache or scheduler:
        base = Strategy(
            f"{base.name}+custom",
            base.description,
            {**base.cache, **(cache or {})},
            {**base.scheduler, **(scheduler or {})},
            base.expect,
            base.inject_empty,
        )
    pset = _passphrases(passphrases)
    cfg = ExperimentConfig(
        trials=trials, concurrency=concurrency, seed=seed, max_tokens=max_tokens, min_tokens=min(8, max_tokens)
    )
    results = Experiment(loaded, pset, cfg).run_strategy(base)
    return summarize(base, results), results


def assert_isolation(
    model: str | LoadedModel = "mini",
    strategy: str | Strategy = "shared-cow",
    **kwargs: Any,
) -> StrategySummary:
    """Fail (AssertionError with root causes) unless every request matched itself run alone and the
    sanitizer saw no foreign read. Returns the summary so callers can assert more (e.g. that sharing
    really happened: ``summary.peak_shared_refcount >= 2``)."""
    summary, results = run_isolation_check(model, strategy, **kwargs)
    bad = [t for t in results if t.contaminated or t.caught]
    if bad:
        lines = [f"{summary.strategy}: {len(bad)} of {summary.trials} trials broke isolation"]
        for t in bad[:5]:
            who = ", ".join(f"{r.name}={r.outcome}" for r in t.requests)
            lines.append(f"  trial {t.index} ({t.group}): {who}")
            lines += [f"    {c}" for c in t.root_causes]
        raise AssertionError("\n".join(lines))
    return summary


def _passphrases(p: str | Path | PassphraseSet | Sequence[Sequence[str]] | None) -> PassphraseSet:
    if p is None:
        return default_passphrases()
    if isinstance(p, PassphraseSet):
        return p
    if isinstance(p, (str, Path)):
        return load_passphrases(p)
    groups = tuple(PassphraseGroup(f"group-{i}", tuple(g)) for i, g in enumerate(p))
    if not groups or not all(g.prompts for g in groups):
        raise ValueError("passphrases: every group needs at least one prompt")
    return PassphraseSet("<inline>", groups)
