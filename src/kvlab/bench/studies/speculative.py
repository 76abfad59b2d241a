"""Speculative decoding by prompt lookup on the throughput benchmark's workloads: how many draft tokens each
workload's greedy requests get accepted, what that saves in engine steps and time, and that the tokens are the
plain run's.

Per workload, the same engine settings twice (``kvlab_knobs``), without and with ``SchedulerConfig.speculative``;
each round's prompts at once, the rounds one after another. With a vLLM peer (``scripts/peers/vllm.sh``), vLLM's
CPU build runs the same rounds twice too (``vllm_knobs``: fp32, its prefix cache emptied before each run),
without and with the same ``speculative_config``; its ``vllm:spec_decode_*`` counters give its drafts. A
workload of n > 1 samples runs the sampling path (temperature 1, top_k 1), which kvlab drafts nothing for: vLLM
verifies sampled drafts by rejection sampling, kvlab drafts for greedy requests only, and the row shows it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvlab.bench.table import ResultTable, result_table, right_columns
from kvlab.bench.workloads import Workload
from kvlab.config import SpeculativeConfig
from kvlab.model.loader import LoadedModel


@dataclass(frozen=True)
class SpecRow:
    workload: str
    engine: str  # "kvlab" or the peer's name and version
    sequences: int
    tokens: int  # generated, all sequences
    identical: int  # sequences whose tokens equal the plain run's
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: tuple[int, ...]
    steps_plain: int  # 0: not known (a peer)
    steps_spec: int
    seconds_plain: float
    seconds_spec: float

    @property
    def acceptance(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"acceptance": self.acceptance}


def run_workload(
    loaded: LoadedModel, w: Workload, max_tokens: int, spec: SpeculativeConfig | None
) -> tuple[list[list[int]], Any, float]:
    """The workload's tokens, the engine's stats and the wall time of its rounds."""
    from kvlab import LLM, SamplingParams
    from kvlab.bench.studies.throughput import kvlab_knobs

    knobs = kvlab_knobs(w.peak(), max_tokens, loaded.config.max_position_embeddings)
    llm = LLM(loaded, speculative=spec, **knobs)
    params = SamplingParams(
        n=w.n, temperature=w.temperature, top_k=w.top_k, seed=w.seed, max_tokens=max_tokens, ignore_eos=True
    )
    tokens: list[list[int]] = []
    t0 = time.perf_counter()
    for prompts in w.rounds:
        for out in llm.generate(prompts, params, use_tqdm=False):
            tokens += [list(c.token_ids) for c in out.outputs]
    return tokens, llm.stats(), time.perf_counter() - t0


def measure(
    loaded: LoadedModel, workloads: Sequence[Workload], max_tokens: int, spec: SpeculativeConfig
) -> tuple[list[SpecRow], list[list[list[int]]]]:
    """kvlab's row per workload, and each workload's plain tokens (what a peer is compared with)."""
    rows, tokens = [], []
    for w in workloads:
        plain, s0, t0 = run_workload(loaded, w, max_tokens, None)
        tokens.append(plain)
        drafted, s1, t1 = run_workload(loaded, w, max_tokens, spec)
        rows.append(
            SpecRow(
                workload=w.name,
                engine="kvlab",
                sequences=len(plain),
                tokens=sum(map(len, plain)),
                identical=sum(a == b for a, b in zip(plain, drafted, strict=True)),
                drafts=s1.spec_decode_num_drafts,
                draft_tokens=s1.spec_decode_num_draft_tokens,
                accepted=s1.spec_decode_num_accepted_tokens,
                accepted_per_pos=s1.spec_decode_num_accepted_tokens_per_pos,
                steps_plain=s0.steps,
                steps_spec=s1.steps,
                seconds_plain=t0,
                seconds_spec=t1,
            )
        )
    return rows, tokens


@dataclass(frozen=True)
class PeerRun:
    """A peer's rows, how many of its plain sequences equal kvlab's per workload, and where it failed (its first
    line), if it did: the workloads after a failure are not run (a dead engine answers nothing more)."""

    rows: list[SpecRow]
    same_as_kvlab: list[int]
    failure: str = ""


def measure_vllm(
    plain: Any, spec: Any, workloads: Sequence[Workload], max_tokens: int, kvlab_tokens: Sequence[list[list[int]]]
) -> PeerRun:
    """The same workloads on two vLLM engines (``VLLMPeer``: without and with speculation)."""
    rows: list[SpecRow] = []
    same_as_kvlab: list[int] = []
    for w, ours in zip(workloads, kvlab_tokens, strict=True):
        run = {"n": w.n, "temperature": w.temperature, "top_k": w.top_k, "seed": w.seed, "reset_prefix_cache": True}
        try:
            base, t0 = plain.run(w.rounds, max_tokens, **run)
            before = spec.spec_metrics()
            drafted, t1 = spec.run(w.rounds, max_tokens, **run)
            after = spec.spec_metrics()
        except Exception as exc:  # the peer's own failure: reported, the rows before it kept
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return PeerRun(rows, same_as_kvlab, f"{w.name}: {first}")
        per_pos = after["num_accepted_tokens_per_pos"]
        was = before["num_accepted_tokens_per_pos"] or [0] * len(per_pos)
        rows.append(
            SpecRow(
                workload=w.name,
                engine=f"vLLM {spec.version}",
                sequences=len(base),
                tokens=sum(map(len, base)),
                identical=sum(a == b for a, b in zip(base, drafted, strict=True)),
                drafts=int(after["num_drafts"] - before["num_drafts"]),
                draft_tokens=int(after["num_draft_tokens"] - before["num_draft_tokens"]),
                accepted=int(after["num_accepted_tokens"] - before["num_accepted_tokens"]),
                accepted_per_pos=tuple(int(a - b) for a, b in zip(per_pos, was, strict=True)),
                steps_plain=0,
                steps_spec=0,
                seconds_plain=t0,
                seconds_spec=t1,
            )
        )
        same_as_kvlab.append(sum(a == b for a, b in zip(base, ours, strict=True)))
    return PeerRun(rows, same_as_kvlab)


def speculative_table(
    rows: Sequence[SpecRow],
    model: str,
    spec: SpeculativeConfig,
    threads: int,
    peer: PeerRun | None = None,
) -> ResultTable:
    """kvlab's rows and, with a ``peer``, its rows, per workload; the peer's agreement with kvlab and its failure
    in the notes."""
    rows = [*rows, *(peer.rows if peer else [])]
    order = {w: k for k, w in enumerate(dict.fromkeys(r.workload for r in rows))}
    same_as_kvlab = peer.same_as_kvlab if peer else []
    notes = [
        "identical: sequences whose greedy tokens equal the same engine's plain run's; steps and time: with "
        "speculation / without, the same engine settings; acceptance: accepted / draft tokens; per position: "
        "accepted tokens at draft positions 0, 1, ... (vLLM's vllm:spec_decode_num_accepted_tokens_per_pos)",
        "n > 1 workloads sample (temperature 1, top_k 1) and kvlab drafts nothing for them: it drafts for greedy "
        "requests only",
    ]
    peer_rows = [r for r in rows if r.engine != "kvlab"]
    if peer_rows and same_as_kvlab:
        pairs = zip(peer_rows, same_as_kvlab, strict=True)
        notes.append(
            f"{peer_rows[0].engine}'s plain tokens equal kvlab's: "
            + ", ".join(f"{r.workload} {n}/{r.sequences}" for r, n in pairs)
        )
    if peer and peer.failure:
        notes.append(f"the peer failed on {peer.failure} (the workloads after it were not run)")
    return result_table(
        f"speculative decoding (ngram, k={spec.num_speculative_tokens}, lookup "
        f"{spec.prompt_lookup_min}..{spec.prompt_lookup_max}): {model}, {threads} threads",
        [
            "workload",
            "engine",
            *right_columns(
                "identical", "drafts", "draft tokens", "accepted", "acceptance", "per position", "steps", "time"
            ),
        ],
        [
            (
                r.workload,
                r.engine,
                f"{r.identical}/{r.sequences}",
                str(r.drafts),
                str(r.draft_tokens),
                str(r.accepted),
                f"{r.acceptance:.0%}",
                " ".join(str(a) for a in r.accepted_per_pos),
                f"{r.steps_spec}/{r.steps_plain} ({r.steps_spec / r.steps_plain:.2f}x)" if r.steps_plain else "-",
                f"{r.seconds_spec:.2f}/{r.seconds_plain:.2f} s ({r.seconds_spec / r.seconds_plain:.2f}x)"
                if r.seconds_plain
                else "-",
            )
            for r in sorted(rows, key=lambda r: order[r.workload])  # kvlab's row, then the peer's, per workload
        ],
        notes=notes,
    )
