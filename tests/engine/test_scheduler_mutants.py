"""The scheduler driven without a model (a ``KVCacheManager`` and hand-made requests), for the mutants of
``engine/scheduler.py`` the suite let live (issue 40; docs/testing.md): what a preemption resets and counts, that a
request never waits for another salt's pending prefix (the wait would tell it that another tenant is computing that
prefix), the seat boundary of the fair share, where a fork's sibling runs, and the waiting queue's own views."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from kvlab.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from kvlab.engine.request import Request, RequestStatus
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.scheduler import ScheduledBatch, Scheduler, WaitingQueue
from kvlab.kv import KVCacheManager

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SYSTEM = list(range(1, 13))  # three blocks of 4


def scheduler(num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=num_blocks))
    return Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=max_num_seqs), kv)


def request(rid: str, prompt: list[int], salt: str | None = None, tenant: str | None = None, t: float = 0.0) -> Request:
    return Request(rid, prompt, PARAMS, cache_salt=salt, tenant=tenant, arrival_time=t)


def admitted(s: Scheduler) -> list[str]:
    with s.kv.step():
        batch = s.schedule()
    return [e.request.request_id for e in batch.scheduled]


def test_a_preemption_resets_the_request_and_counts_once() -> None:
    s = scheduler()
    a, b = request("a", SYSTEM + [40]), request("b", SYSTEM + [41])
    s.add(a)
    s.add(b)
    assert admitted(s) == ["a"]  # b waits a step for a's pending prefix (the same salt)
    a.num_computed_tokens = 13
    for n in (1, 2):
        if a not in s.running:
            s.waiting.remove(a)
            s.running.append(a)
            s.kv.allocate("a", a.all_token_ids, num_tokens=13)
        s.preempt(a)
        assert (a.num_computed_tokens, a.status, a.num_preemptions, a.metrics.num_preemptions) == (
            0, RequestStatus.WAITING, n, n,
        )  # fmt: skip
        assert s.num_preemptions == n and not s.kv.has_request("a") and s.waiting.heads()[0] is a
    s.waiting.remove(b)
    s.running.append(b)
    s.kv.allocate("b", b.all_token_ids, num_tokens=13)
    s.preempt(b)
    assert s.num_preemptions == 3, "the engine's count is over every request"


def test_a_request_never_waits_for_another_salts_pending_prefix() -> None:
    """Two prompts with the same first blocks arrive together. Under one salt the second waits a step, to hit what
    the first computes; under two salts it cannot share those blocks, and waiting would only tell its tenant that
    someone is computing them."""
    same = scheduler()
    same.add(request("a", SYSTEM + [40], salt="t1"))
    same.add(request("b", SYSTEM + [41], salt="t1"))
    assert admitted(same) == ["a"]
    apart = scheduler()
    apart.add(request("a", SYSTEM + [40], salt="t1"))
    apart.add(request("b", SYSTEM + [41], salt="t2"))
    assert admitted(apart) == ["a", "b"]


def test_a_request_waits_only_for_a_block_it_will_share() -> None:
    """The first block ``a`` writes is its first: ``b`` waits only if it holds that whole block and goes on past it."""
    for prompt_b, waits in (
        (SYSTEM[:4] + [41], True),  # shares a's first block, and has a token after it
        (SYSTEM[:4], False),  # that block is all of b: its last token is computed anyway
        (SYSTEM[:3] + [41, 42], False),  # parts inside the first block
        (SYSTEM[:8] + [41], True),
    ):
        s = scheduler()
        s.add(request("a", SYSTEM + [40]))
        s.add(request("b", prompt_b))
        assert admitted(s) == (["a"] if waits else ["a", "b"]), prompt_b
    s = scheduler()  # a prompt of exactly one block fills it, and the block becomes findable: worth the wait
    s.add(request("a", SYSTEM[:4]))
    s.add(request("b", SYSTEM[:4] + [41]))
    assert admitted(s) == ["a"]


def test_across_salts_a_request_waits_for_a_public_block_both_declared() -> None:
    """A block both declared public is keyed without a salt: shared across tenants by their choice, so waiting a
    step to hit it tells nothing they did not publish."""
    s = scheduler()
    s.add(Request("a", SYSTEM + [40], PARAMS, cache_salt="t1", public_prefix_tokens=8))
    s.add(Request("b", SYSTEM + [41], PARAMS, cache_salt="t2", public_prefix_tokens=8))
    assert admitted(s) == ["a"]


def test_a_tenant_is_not_preempted_when_the_waiting_head_takes_the_last_seat() -> None:
    """Fairness preempts only for a head that finds no seat: one that takes exactly the last seat does not."""
    s = scheduler(max_num_seqs=3)
    for rid in ("a1", "a2"):
        s.add(request(rid, [7, 8, 9], tenant="A"))
    assert admitted(s) == ["a1", "a2"]
    s.add(request("b1", [5, 6], tenant="B", t=1.0))
    assert admitted(s) == ["a1", "a2", "b1"] and s.num_preemptions == 0


def test_a_fork_runs_right_behind_its_parent() -> None:
    s = scheduler()
    for rid in ("p", "q", "r"):
        s.add(request(rid, [1, 2, 3, ord(rid)]))
    admitted(s)
    parent = next(r for r in s.running if r.request_id == "q")
    child = parent.fork("q#1", 1)
    s.add_running(child, after=parent)
    assert [r.request_id for r in s.running] == ["p", "q", "q#1", "r"]


def test_the_waiting_queue_knows_its_requests_and_its_oldest_head() -> None:
    q = WaitingQueue()
    late, early, other = request("late", [1], tenant="A", t=2.0), request("x", [1], tenant="A", t=3.0), None
    q.append(late)
    q.append(early)
    first_b = request("b", [1], tenant="B", t=1.0)
    q.append(first_b)
    assert q.oldest() is first_b and late in q and first_b in q and other not in q
    assert request("late", [1], tenant="A", t=2.0) not in q, "membership is by identity within its tenant's queue"
    assert request("elsewhere", [1], tenant="C") not in q
    q.remove(first_b)
    assert q.oldest() is late and first_b not in q and len(q) == 2


def fairness_preemptions(
    cached_salt: str | bool | None, head_salt: str | None, head: list[int], public: int = 0
) -> int:
    """Tenant A runs two requests holding all but the blocks ``head``'s cached prefix would fill; tenant B's head
    ``head`` arrives. How many of A's requests fairness preempts for it. ``cached_salt``: the salt ``head``'s
    tokens were computed and freed under before (False: never), the blocks then free but findable; ``public``: the
    prefix both declared public."""
    cached = (len(head) - 1) // 4 if cached_salt is not False else 0  # full blocks before its last token
    s = scheduler(num_blocks=6 + cached)
    if cached_salt is not False:
        with s.kv.step():
            salt = cached_salt if isinstance(cached_salt, str) else None
            s.kv.allocate("earlier", head, salt, num_tokens=len(head), public_prefix_tokens=public)
        s.kv.free("earlier")
    for rid in ("a1", "a2"):
        s.add(request(rid, [ord(rid[-1])] * 9, salt="a", tenant="A"))  # three blocks each
    assert admitted(s) == ["a1", "a2"]
    for r in s.running:  # as the engine would: their prompts computed, nothing more to schedule this time
        r.num_computed_tokens = r.num_tokens
    s.add(Request("b1", head, PARAMS, cache_salt=head_salt, tenant="B", arrival_time=1.0, public_prefix_tokens=public))
    admitted(s)
    return s.num_preemptions


def test_a_waiting_heads_fit_counts_its_own_cached_prefix_and_no_one_elses() -> None:
    """Whether fairness preempts another tenant for a waiting head depends on the blocks the head would need, its
    own cached prefix deducted (_fits). Here the only free blocks are that prefix's: under the head's own salt it
    fits exactly (two blocks: the one it computes, the copy-on-write spare), so nobody is preempted. The same
    tokens cached under another salt, or without one, are not the head's to hit: the estimate must not count them,
    or another tenant's cache would decide (and so reveal, through who is preempted when) this tenant's
    scheduling."""
    head = SYSTEM[:8] + [50]  # two full blocks cached, the last token computed
    assert fairness_preemptions("b", "b", head) == 0
    assert fairness_preemptions("a", "b", head) == 1
    assert fairness_preemptions(None, "b", head) == 1
    assert fairness_preemptions(False, "b", head) == 1
    assert fairness_preemptions(None, None, head) == 0  # unsalted both: the same cache, shared by the operator's choice
    assert fairness_preemptions("a", "b", head, public=8) == 0  # a prefix both declared public is the head's to hit


def test_finishing_a_waiting_request_takes_it_out_of_the_queue_and_finishing_twice_is_harmless() -> None:
    """An abort may reach a request still waiting: it leaves the queue (it would otherwise be admitted, and run, after
    its end), holds no blocks, and keeps its reason; a second finish (the engine's abort after a finish) changes
    nothing."""
    s = scheduler()
    a, b = request("a", [1, 2, 3]), request("b", [9, 8, 7])
    s.add(a)
    s.add(b)
    s.finish(b, "abort", RequestStatus.ABORTED)
    assert b not in s.waiting and len(s.waiting) == 1 and s.num_unfinished == 1
    assert (b.status, b.finish_reason) == (RequestStatus.ABORTED, "abort")
    assert admitted(s) == ["a"] and not s.kv.has_request("b")
    s.finish(a, "stop")
    s.finish(a, "stop")
    assert s.num_unfinished == 0 and not s.kv.has_request("a") and a.finish_reason == "stop"


def sampled_once(reqs: Iterable[Request]) -> None:
    """Put each request where the engine leaves it after its prompt's step: the prompt computed and one output token
    sampled, so that its next step is a decode."""
    for k, r in enumerate(reqs):
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(90 + k)


def decoding(s: Scheduler, *reqs: Request) -> list[Request]:
    """Admit ``reqs`` (one step, all of them), then ``sampled_once``."""
    for r in reqs:
        s.add(r)
    assert admitted(s) == [r.request_id for r in reqs]
    sampled_once(reqs)
    return list(reqs)


def test_the_running_requests_stop_exactly_where_the_budget_runs_out() -> None:
    """Two decoding requests: a budget of 2 schedules both, a budget of 1 only the first, and the second is not put in
    the batch with zero tokens."""
    for budget, expect in ((2, ["a", "b"]), (1, ["a"])):
        s = scheduler()
        decoding(s, request("a", list(range(1, 9))), request("b", [20, 21, 22]))
        s.config = replace(s.config, max_num_batched_tokens=budget)
        with s.kv.step():
            batch = s.schedule()
        assert [(e.request.request_id, e.num_tokens) for e in batch.scheduled] == [(r, 1) for r in expect], budget


def test_an_empty_request_takes_no_token_and_the_loop_goes_on_past_it() -> None:
    """The unsafe path that lets an empty prompt in (filter_empty=False): it is scheduled every step with no token
    and no slot, and the requests behind it are scheduled as usual; a one-token prompt is not empty."""
    s = scheduler()
    x, e, y = request("x", [1, 2, 3], t=0.0), request("e", [], t=1.0), request("y", [7], t=2.0)
    for r in (x, e, y):
        s.add(r)
    with s.kv.step():
        first = s.schedule()
    assert [(en.request.request_id, en.num_tokens, len(en.slots)) for en in first.scheduled] == [
        ("x", 3, 3), ("e", 0, 0), ("y", 1, 1),
    ]  # fmt: skip
    sampled_once((x, y))
    with s.kv.step():
        second = s.schedule()
    assert [(en.request, en.num_tokens, len(en.slots), en.draft) for en in second.scheduled] == [
        (x, 1, 1, []), (e, 0, 0, []), (y, 1, 1, []),
    ]  # fmt: skip
    assert second.scheduled[1].slots == [] and second.preempted == []


def test_a_request_preempted_for_blocks_is_named_in_the_batch() -> None:
    """The pool runs dry while running requests take their next slots: the victim (the newest) is preempted, named in
    the batch's ``preempted`` (the engine reports and counts from it) and back at the head of the queue."""
    s = scheduler(num_blocks=3)
    _, b = decoding(s, request("a", [1, 2, 3, 4]), request("b", [5, 6, 7, 8]))  # a block each, one left
    with s.kv.step():
        batch = s.schedule()
    assert [e.request.request_id for e in batch.scheduled] == ["a"]
    assert batch.preempted == [b] and s.waiting.heads() == [b] and b.status == RequestStatus.WAITING


def test_only_a_greedy_single_sequence_request_gets_a_draft() -> None:
    """vLLM verifies sampled drafts by rejection sampling, kvlab does not: a sampled request, or a greedy one with
    n > 1, decodes one token a step even where its context repeats."""
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2)
    loop = [1, 2, 3, 1, 2, 3, 1, 2]
    drafts = {}
    for name, params in (
        ("greedy", PARAMS),
        ("sampled", SamplingParams(temperature=0.8, max_tokens=4, seed=1)),
        ("greedy n=2", SamplingParams(temperature=0, max_tokens=4, n=2, ignore_eos=True)),
    ):
        kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=64))
        s = Scheduler(SchedulerConfig(max_model_len=64, speculative=spec), kv)
        (r,) = decoding(s, Request("r", list(loop), params))
        r.output_token_ids[-1] = 3  # the context ends 1, 2, 3: its last n-gram recurs
        with s.kv.step():
            drafts[name] = s.schedule().scheduled[0].draft
    assert drafts == {"greedy": [1, 2], "sampled": [], "greedy n=2": []}  # max_tokens=4 leaves room for 2


def three_decoding(needs_block: str) -> tuple[Scheduler, dict[str, Request]]:
    """Running in this order: a1, a2 (tenant A), b1 (tenant B), each past its prompt with one output token, and not
    a free block left (a request outside the scheduler holds the rest); only ``needs_block``'s next token starts a
    new block."""
    prompt = {"a1": [1, 2], "a2": [3, 4], "b1": [5, 6]}
    prompt[needs_block] = prompt[needs_block] + [7, 8]  # a full block: its output token then needs a new one
    s = scheduler(num_blocks=8)
    reqs = {rid: request(rid, prompt[rid], tenant=rid[0].upper(), t=k) for k, rid in enumerate(prompt)}
    for rid in ("a1", "a2"):  # A alone first, so that a2 runs ahead of b1 (fair admission would take b1 first)
        s.add(reqs[rid])
    assert admitted(s) == ["a1", "a2"]
    s.add(reqs["b1"])
    for r in (reqs["a1"], reqs["a2"]):
        r.num_computed_tokens = r.num_tokens
    assert admitted(s) == ["a1", "a2", "b1"]
    reqs["b1"].num_computed_tokens = reqs["b1"].num_tokens
    for k, r in enumerate(reqs.values()):
        r.output_token_ids.append(90 + k)
    with s.kv.step():
        s.kv.allocate("elsewhere", list(range(100, 100 + 4 * s.kv.num_free_blocks())))
    assert s.kv.num_free_blocks() == 0
    return s, reqs


def test_a_request_that_gives_up_its_own_seat_lets_the_ones_behind_it_run() -> None:
    """a2 needs a block and the pool is dry: the newest sequence of the busiest tenant among those not yet scheduled
    is a2 itself, so a2 goes back to the queue, and b1 behind it is still scheduled this step."""
    s, r = three_decoding("a2")
    with s.kv.step():
        batch = s.schedule()
    assert [e.request.request_id for e in batch.scheduled] == ["a1", "b1"] and batch.preempted == [r["a2"]]


def test_a_victim_is_never_a_request_already_scheduled_in_the_step() -> None:
    """b1 needs a block and the pool is dry. A is the busier tenant, but a1 and a2 already hold this step's slots:
    preempting one of them would free blocks the batch is about to write. Only b1 (itself) can go."""
    s, r = three_decoding("b1")
    with s.kv.step():
        batch = s.schedule()
    assert [e.request.request_id for e in batch.scheduled] == ["a1", "a2"] and batch.preempted == [r["b1"]]
    assert all(e.request in s.running for e in batch.scheduled)


def fairness_step(*heads: Request) -> tuple[list[str], list[str]]:
    """Tenant B runs four sequences, every seat (max_num_seqs=4); ``heads`` arrive. Which of B's sequences fairness
    preempts this step, in order, and which requests the step schedules."""
    s = scheduler(max_num_seqs=4)
    for k in range(4):
        s.add(request(f"b{k}", [10 * k + 1, 10 * k + 2], tenant="B", t=k))
    admitted(s)
    sampled_once(s.running)
    for h in heads:
        s.add(h)
    with s.kv.step():
        batch = s.schedule()
    return [r.request_id for r in batch.preempted], [e.request.request_id for e in batch.scheduled]


def seats(rid: str, tenant: str, n: int, t: float) -> Request:
    return Request(
        rid, [7, 7, 7], SamplingParams(temperature=1.0, n=n, max_tokens=4, seed=1), tenant=tenant, arrival_time=t
    )


def test_a_head_needing_two_seats_takes_two_from_the_busiest_tenant_and_the_batch_names_both() -> None:
    """A's head asks for two sequences (n=2); B holds all four seats. B gives up its two newest (4 -> 3 -> 2 seats,
    each time still no fewer than A would have), and the batch names both."""
    preempted, scheduled = fairness_step(seats("a", "A", 2, 10.0))
    assert preempted == ["b3", "b2"] and scheduled == ["b0", "b1", "a"]


def test_a_head_that_cannot_be_made_room_for_stops_the_preemptions_behind_it() -> None:
    """A's head asks for four sequences: B giving one up would leave it 3 against A's 4, not fairer, so A waits.
    Admission takes A's head first (the fewest sequences, the oldest) and stops there, so a seat freed for C's head,
    behind it, would stay empty this step: B keeps all four (before, B's newest was preempted for nothing)."""
    preempted, scheduled = fairness_step(seats("a", "A", 4, 10.0), seats("c", "C", 1, 11.0))
    assert preempted == [] and scheduled == ["b0", "b1", "b2", "b3"]


def test_a_seat_made_for_one_head_is_not_counted_free_again_for_the_next() -> None:
    """A's and C's heads ask for one sequence each against B's four (every seat): B gives up its newest for A
    (4 - 1 >= 0 + 1), and its next for C (3 - 1 >= 0 + 1): C's fit counts the seat A will take, so both are admitted
    in the step (before, C found A's seat free, nothing was preempted for it, and it waited a step)."""
    preempted, scheduled = fairness_step(seats("a", "A", 1, 10.0), seats("c", "C", 1, 11.0))
    assert preempted == ["b3", "b2"] and scheduled == ["b0", "b1", "a", "c"]


def two_heads_step() -> tuple[Scheduler, ScheduledBatch]:
    """X and Y run two one-block sequences each; five blocks are free, six seats. X's head (two sequences of a
    three-token prompt) and Y's (20 tokens: 5 blocks and a spare) arrive; the scheduler and its step."""
    s = scheduler(num_blocks=9, max_num_seqs=6)
    for k, rid in enumerate(("x0", "y0", "x1", "y1")):
        s.add(request(rid, [k + 1, k + 1], tenant=rid[0].upper(), t=k))
    admitted(s)
    sampled_once(s.running)
    s.add(seats("x", "X", 2, 10.0))
    s.add(request("y", list(range(100, 120)), tenant="Y", t=11.0))
    assert s.kv.num_free_blocks() == 5
    with s.kv.step():
        return s, s.schedule()


def test_a_later_head_weighs_an_earlier_heads_tenant_as_if_it_had_been_admitted() -> None:
    """``two_heads_step``: seats are not short. X's head fits. Y's head does not, and X counts as the 4 it will have:
    X gives up its newest (4 - 1 >= 2 + 1); counted as 2 it would not (1 < 3)."""
    _, batch = two_heads_step()
    assert [r.request_id for r in batch.preempted] == ["x1"]


def test_a_sequence_preempted_for_a_head_is_not_admitted_again_ahead_of_it() -> None:
    """``two_heads_step``, admitted: x1, preempted for Y's head, waits at the front of X's queue for the next step, and
    admission takes the heads fairness weighed, X's and Y's (before, x1 was X's head again and, X now running the
    fewest, was admitted first: it took back the seat and the block it gave up, and Y's head found no room)."""
    s, batch = two_heads_step()
    assert [r.request_id for r in batch.preempted] == ["x1"]
    assert [e.request.request_id for e in batch.scheduled] == ["x0", "y0", "y1", "x", "y"]
    x1 = s.waiting.heads()[0]
    assert [r.request_id for r in s.waiting] == ["x1"]
    assert (x1.status, x1.num_computed_tokens) == (RequestStatus.WAITING, 0)


def test_admission_stops_at_the_seat_limit_and_records_whose_request_it_is() -> None:
    """max_num_seqs=2 and three one-sequence requests of one tenant: two are admitted in the step, as RUNNING, and the
    KV manager knows each one's tenant (promotion counts parties by it)."""
    s = scheduler(max_num_seqs=2)
    reqs = [request(f"x{k}", [k + 1, k + 2, k + 3], tenant="A", t=k) for k in range(3)]
    for r in reqs:
        s.add(r)
    assert admitted(s) == ["x0", "x1"]
    assert [r.status for r in reqs] == [RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.WAITING]
    assert s.kv.table("x0").tenant == "A" and s.kv.table("x1").tenant == "A"


def test_admission_uses_exactly_the_budget_the_running_requests_left() -> None:
    """One decoding request and one waiting: a budget of 2 leaves 1 token, and the waiting request is admitted with
    that one token (a chunk); a budget of 1 leaves none, and nobody is admitted with zero tokens."""
    for budget, expect in ((2, [("a", 1), ("w", 1)]), (1, [("a", 1)])):
        s = scheduler()
        decoding(s, request("a", [1, 2, 3]))
        s.add(request("w", [20, 21, 22, 23, 24]))
        s.config = replace(s.config, max_num_batched_tokens=budget)
        with s.kv.step():
            batch = s.schedule()
        assert [(e.request.request_id, e.num_tokens) for e in batch.scheduled] == expect, budget


def test_without_chunking_a_prompt_is_admitted_only_when_its_own_uncached_part_fits_the_budget_left() -> None:
    """Without chunked prefill a prompt is admitted whole or not at all. x's 40 tokens leave 24 of the step's 64; y has
    30 tokens, of which the first 8 were computed before. Under y's own salt (or as a public prefix both declared)
    they are a hit, 22 tokens remain and y is admitted, with its cached and public counts. Under another salt, or
    none, they are not y's: 30 do not fit, and y waits (whether it waits must not depend on another tenant's cache)."""
    prefix = list(range(100, 108))
    for cached_salt, public, admits in (("y", 0, True), ("x", 8, True), ("x", 0, False), (None, 0, False)):
        kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=64))
        s = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64, enable_chunked_prefill=False), kv)
        with kv.step():
            kv.allocate("earlier", [*prefix, 1], cached_salt, public_prefix_tokens=public)
        kv.free("earlier")
        s.add(request("x", list(range(200, 240)), salt="x", t=0.0))
        y = Request(
            "y", [*prefix, *range(300, 322)], PARAMS, cache_salt="y", arrival_time=1.0, public_prefix_tokens=public
        )
        s.add(y)
        with s.kv.step():
            batch = s.schedule()
        got = [(e.request.request_id, e.num_tokens) for e in batch.scheduled]
        assert got == ([("x", 40), ("y", 22)] if admits else [("x", 40)]), (cached_salt, public)
        if admits:
            assert (y.num_cached_tokens, y.num_public_cached_tokens) == (8, public)
