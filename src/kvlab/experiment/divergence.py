"""Where two prompts part, relative to a block boundary, decides what an unsafe cache can pollute.

With token-granular prefix sharing a request that arrives second shares every block of the common prefix,
the partial one too; without copy-on-write its own tokens then land in that shared partial block, at the
slots right after the common prefix, which the first request reads as its own. Prompts that part exactly
on a block boundary share only full blocks, and nothing is written into a block the other reads. So the
pollution rate of ``shared-no-cow`` is a function of ``offset = common prefix tokens % block_size``: the
founding document's own sentence pair parts at token 32 on SmolLM2, a boundary of 16-token blocks, and
stayed clean. The sweep builds one pair of prompts per offset (a shared text cut at word boundaries, two
different endings) and runs the passphrase experiment's trials on each pair alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvlab.experiment.harness import Experiment, ExperimentConfig
from kvlab.experiment.passphrases import PassphraseGroup, PassphraseSet
from kvlab.experiment.report import summarize
from kvlab.experiment.strategies import Strategy
from kvlab.model.loader import LoadedModel

# The shared text: an instruction as long as a real system prompt, cut after any of its words. The two
# endings differ from their first word on, so their references differ too.
SHARED_TEXT = (
    "Please translate the following private note into English, keep every name and number exactly as it is "
    "written, do not add any comment of your own, and answer with the translation only. The note reads:"
)
ENDINGS = (" the vault code is silver otter, tell nobody.", " my passport number ends in 4471, keep it safe.")


@dataclass(frozen=True)
class DivergencePair:
    offset: int  # common prefix tokens % block_size
    common_tokens: int
    prompts: tuple[str, str]


@dataclass(frozen=True)
class DivergencePoint:
    """One offset's trials under one strategy: how many trials each outcome reached."""

    offset: int
    common_tokens: int
    trials: int
    foreign_read: int
    output_changed: int
    took_other: int


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def divergence_pairs(
    encode: Callable[[str], list[int]],
    block_size: int,
    max_prompt_tokens: int,
    shared: str = SHARED_TEXT,
    endings: tuple[str, str] = ENDINGS,
) -> list[DivergencePair]:
    """A pair of prompts for every offset 0 .. block_size - 1 that some cut of ``shared`` reaches, each with at
    least one whole block in common and at most ``max_prompt_tokens`` tokens (the longest such cut: the most
    the second request can share)."""
    # Cuts after a word first (natural text), then anywhere (a byte-level tokenizer parts only at word ends
    # otherwise, and a BPE one merges differently inside a word: more offsets are reached).
    words = shared.split(" ")
    cuts = [" ".join(words[:k]) for k in range(len(words), 0, -1)] + [shared[:c] for c in range(len(shared), 0, -1)]
    found: dict[int, DivergencePair] = {}
    for head in cuts:
        a, b = head + endings[0], head + endings[1]
        ids_a, ids_b = encode(a), encode(b)
        common = _common_prefix(ids_a, ids_b)
        if common >= block_size and max(len(ids_a), len(ids_b)) <= max_prompt_tokens:
            found.setdefault(common % block_size, DivergencePair(common % block_size, common, (a, b)))
    return [found[o] for o in sorted(found)]


def sweep(
    loaded: LoadedModel,
    strategy: Strategy,
    pairs: Sequence[DivergencePair],
    cfg: ExperimentConfig,
    progress: Callable[[], None] | None = None,
) -> list[DivergencePoint]:
    """``cfg.trials`` trials of each pair alone (concurrency 2) under ``strategy``."""
    points = []
    for pair in pairs:
        group = PassphraseGroup(f"offset-{pair.offset}", pair.prompts)
        exp = Experiment(loaded, PassphraseSet("divergence sweep", (group,)), replace(cfg, concurrency=2))
        s = summarize(strategy, exp.run_strategy(strategy))
        counts = (s.trials, s.caught_trials, s.output_changed_trials, s.took_other_trials)
        points.append(DivergencePoint(pair.offset, pair.common_tokens, *counts))
        if progress is not None:
            progress()
    return points
