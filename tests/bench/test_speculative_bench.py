"""``kvlab bench speculative``: kvlab's rows count what the engine counted and its tokens equal the plain run's;
a peer's rows are the differences of its counters around the run (a stand-in peer here: the real one is vLLM's
CPU build, outside the suite)."""

from __future__ import annotations

from typing import Any

from kvlab.bench.studies.speculative import measure, measure_vllm, speculative_table
from kvlab.bench.workloads import WorkloadSizes, build_workloads
from kvlab.config import SpeculativeConfig
from oracle_cache import mini

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3)


def test_kvlab_rows_count_drafts_and_keep_the_plain_tokens() -> None:
    loaded = mini()
    sizes = WorkloadSizes(sessions=2, turns=2, parallel_requests=2, n=2)
    workloads = build_workloads(loaded, ["shared-prefix", "chat", "parallel"], [4], 12, sizes)
    rows, plain = measure(loaded, workloads, 12, SPEC)
    assert [r.workload for r in rows] == [w.name for w in workloads]
    for r, w, tokens in zip(rows, workloads, plain, strict=True):
        assert r.engine == "kvlab" and r.identical == r.sequences == len(tokens) == len(w.prompts) * w.n
        assert r.tokens == sum(map(len, tokens)) == 12 * r.sequences
        assert sum(r.accepted_per_pos) == r.accepted <= r.draft_tokens and len(r.accepted_per_pos) == 3
        assert r.steps_plain - r.steps_spec >= 0
    parallel = rows[-1]
    assert parallel.drafts == 0, "sampled requests draft nothing"
    assert any(r.drafts for r in rows[:-1])


class StandIn:
    """A peer whose tokens and counters are given: each run adds ``draft`` drafts of which ``accepted`` pass."""

    version = "9.9"

    def __init__(self, tokens: list[list[int]], drafts: int = 0, accepted: int = 0) -> None:
        self.tokens, self.drafts, self.accepted = tokens, drafts, accepted
        self.counters = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.per_pos = [0, 0]

    def run(self, rounds: Any, max_tokens: int, **kw: Any) -> tuple[list[list[int]], float]:
        self.counters["num_drafts"] += self.drafts
        self.counters["num_draft_tokens"] += 2 * self.drafts
        self.counters["num_accepted_tokens"] += self.accepted
        self.per_pos = [self.per_pos[0] + self.accepted, self.per_pos[1]]
        return self.tokens, 2.0 if self.drafts else 4.0

    def spec_metrics(self) -> dict[str, Any]:
        return {**self.counters, "num_accepted_tokens_per_pos": list(self.per_pos) if self.drafts else []}


def test_a_peers_rows_are_its_counters_around_each_run() -> None:
    loaded = mini()
    workloads = build_workloads(loaded, ["shared-prefix"], [2], 4)
    plain = StandIn([[1, 2], [3, 4]])
    drafted = StandIn([[1, 2], [3, 5]], drafts=5, accepted=3)
    peer = measure_vllm(plain, drafted, workloads * 2, 4, [[[1, 2], [3, 4]], [[1, 2], [9, 9]]])
    assert peer.same_as_kvlab == [2, 1] and peer.failure == ""
    for r in peer.rows:  # the second run's row counts the second run only
        assert (r.engine, r.identical, r.drafts, r.draft_tokens, r.accepted) == ("vLLM 9.9", 1, 5, 10, 3)
        assert r.accepted_per_pos == (3, 0) and (r.seconds_spec, r.seconds_plain) == (2.0, 4.0)
    table = speculative_table([], "mini", SPEC, 2, peer)
    assert table.rows[0][1:4] == ("vLLM 9.9", "1/2", "5") and table.rows[0][-2] == "-"
    assert table.notes[-1] == "vLLM 9.9's plain tokens equal kvlab's: W2 2/2, W2 1/2"


class Dying(StandIn):
    """A peer whose engine dies on its second workload, as vLLM's CPU build did on sampled drafts with top_k."""

    def run(self, rounds: Any, max_tokens: int, **kw: Any) -> tuple[list[list[int]], float]:
        if kw.get("top_k"):
            raise RuntimeError("vLLM failed: EngineDeadError: EngineCore encountered an issue.\nTraceback ...")
        return super().run(rounds, max_tokens, **kw)


def test_a_peer_that_dies_keeps_the_rows_before_and_says_where() -> None:
    loaded = mini()
    sizes = WorkloadSizes(parallel_requests=2, n=2)
    workloads = build_workloads(loaded, ["shared-prefix", "parallel", "chat"], [2], 4, sizes)
    peer = measure_vllm(Dying([[1]] * 2), Dying([[1]] * 2, drafts=1), workloads, 4, [[[1]] * 2] * 3)
    assert [r.workload for r in peer.rows] == ["W2"] and peer.same_as_kvlab == [2]
    assert peer.failure == "W2 n=2: vLLM failed: EngineDeadError: EngineCore encountered an issue."
    table = speculative_table([], "mini", SPEC, 2, peer)
    assert table.notes[-1] == (
        "the peer failed on W2 n=2: vLLM failed: EngineDeadError: EngineCore encountered an issue. (the workloads "
        "after it were not run)"
    )
