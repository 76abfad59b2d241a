"""Copy-on-write decided at the write or at allocation (``CacheConfig.cow_check``), on three workloads.

The founding document (section 5.2) says: some implementations check the refcount before each write, others
at allocation; the first is more precise, the second copies blocks that need no copy; checking at write time
is cheaper in most cases. This runs both moments on the same workloads, one after the other in one process,
and compares them token by token:

* ``passphrase``: the trial plans of ``kvlab experiment`` over the default passphrase groups (2 concurrent
  requests sharing a prefix, seeded arrival offsets and output lengths), greedy, a fresh engine per trial;
* ``fork``: the throughput benchmark's shared-prefix prompts, each sampled ``n`` times (``n > 1`` forks the
  siblings at the first token, sharing the prompt's partial last block) at temperature 1 with a seed. One
  token in nine is a stop token, so siblings end at different lengths, some of them before they write;
* ``chat``: sessions that share a system prompt and go on turn after turn. Each turn's prompt is the previous
  prompt + the answer + new user text, and a session's next turn arrives as soon as its answer is done (a
  session ends early when its next turn would not fit the context).

Per mode: copies made, those made at allocation, those not needed (an eager copy whose request was freed
before it wrote into it), copies made beyond what "write" made on the same workload, bytes copied, wall time
inside the KV manager's calls and inside the block copies per engine step, and the total time. Timings are
measured here and never asserted in tests.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvlab.bench.names import COW_WORKLOADS
from kvlab.bench.table import ResultTable, result_table
from kvlab.bench.workloads import shared_prefix_prompts
from kvlab.config import COW_CHECKS, CacheConfig, SchedulerConfig
from kvlab.engine.engine import Engine
from kvlab.engine.request import RequestOutput
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.sizing import default_max_model_len
from kvlab.experiment.harness import Experiment, ExperimentConfig, plan_trials
from kvlab.experiment.passphrases import default_passphrases
from kvlab.model.loader import LoadedModel

WORKLOADS = COW_WORKLOADS
# The manager's calls that do its work: the prefix lookup and every state change (allocate() calls
# append_slots() itself: only the outer call is timed). Read-only views (block_table, refcount...) are not.
KV_CALLS = ("lookup", "allocate", "append_slots", "fork", "free", "commit_writes")
STOP_EVERY = 9  # fork workload: every 9th token id stops a sibling
CHAT_SYSTEM = "You are a careful assistant for a travel agency. Answer in two short sentences."
MAX_STEPS = 100_000


@dataclass(frozen=True)
class CowSizes:
    trials: int = 100  # passphrase: trials (the experiment's default), 2 concurrent requests each
    requests: int = 32  # fork: prompts
    n: int = 4  # fork: samples per prompt
    sessions: int = 8  # chat: concurrent sessions
    turns: int = 6  # chat: turns per session
    max_tokens: int = 16  # fork and chat (passphrase trials draw theirs, 8..16, as the experiment does)
    seed: int = 0


class _Meter:
    """Wall time inside one engine's KV manager calls and inside its block copies (perf_counter around each
    outermost call), by wrapping the bound methods on the instances."""

    def __init__(self, eng: Engine) -> None:
        self.kv_seconds = 0.0
        self.copy_seconds = 0.0
        self._depth = 0
        for name in KV_CALLS:
            setattr(eng.kv, name, self._timed(getattr(eng.kv, name), kv=True))
        eng.storage.copy_blocks = self._timed(eng.storage.copy_blocks, kv=False)  # type: ignore[method-assign]

    def _timed(self, fn: Callable[..., Any], kv: bool) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if kv and self._depth:
                return fn(*args, **kwargs)
            self._depth += kv
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self._depth -= kv
                if kv:
                    self.kv_seconds += dt
                else:
                    self.copy_seconds += dt

        return call


@dataclass
class CowRun:
    """One workload under one ``cow_check`` (summed over the engines it ran on)."""

    workload: str
    cow_check: str
    requests: int = 0
    sequences: int = 0  # n per request
    output_tokens: int = 0
    steps: int = 0
    cow_copies: int = 0
    cow_copies_eager: int = 0
    cow_copies_unneeded: int = 0
    cow_bytes: int = 0
    storage_bytes_copied: int = 0  # what the storage itself copied: equals cow_bytes
    block_nbytes: int = 0  # bytes of one block (K and V, every layer)
    kv_seconds: float = 0.0
    copy_seconds: float = 0.0
    total_seconds: float = 0.0
    tokens: dict[str, list[tuple[int, ...]]] = field(default_factory=dict, repr=False)

    def add(self, eng: Engine, meter: _Meter, outputs: dict[str, RequestOutput], seconds: float) -> None:
        s = eng.kv.stats
        self.requests += len(outputs)
        self.sequences += sum(len(o.outputs) for o in outputs.values())
        self.output_tokens += sum(len(c.token_ids) for o in outputs.values() for c in o.outputs)
        self.steps += eng.scheduler.step
        self.cow_copies += s.cow_copies
        self.cow_copies_eager += s.cow_copies_eager
        self.cow_copies_unneeded += s.cow_copies_unneeded
        self.cow_bytes += s.cow_bytes
        self.storage_bytes_copied += eng.storage.bytes_copied
        self.block_nbytes = eng.storage.block_nbytes
        self.kv_seconds += meter.kv_seconds
        self.copy_seconds += meter.copy_seconds
        self.total_seconds += seconds
        for key, out in outputs.items():
            self.tokens[key] = [tuple(c.token_ids) for c in out.outputs]

    @property
    def kv_us_per_step(self) -> float:
        return 1e6 * self.kv_seconds / self.steps if self.steps else 0.0

    @property
    def copy_us_per_step(self) -> float:
        return 1e6 * self.copy_seconds / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "tokens"}
        per_step = {
            "kv_us_per_step": round(self.kv_us_per_step, 2),
            "copy_us_per_step": round(self.copy_us_per_step, 2),
        }
        return d | per_step


@dataclass(frozen=True)
class CowComparison:
    """Both modes on one workload. ``mismatches``: the requests whose tokens differ between them."""

    workload: str
    write: CowRun
    allocate: CowRun
    mismatches: tuple[str, ...]

    @property
    def identical(self) -> bool:
        return not self.mismatches

    @property
    def extra_copies(self) -> int:
        """Copies "allocate" made beyond those "write" made on the same workload."""
        return self.allocate.cow_copies - self.write.cow_copies

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "identical": self.identical,
            "mismatches": list(self.mismatches),
            "extra_copies": self.extra_copies,
            "runs": [self.write.as_dict(), self.allocate.as_dict()],
        }


def cow_table(
    rows: Sequence[CowComparison], model: str, block_size: int, num_blocks: int, threads: int, repeats: int
) -> ResultTable:
    """Both modes of every workload, one line each (a token mismatch shows in red in "identical")."""
    kib = rows[0].write.block_nbytes / 1024 if rows else 0
    columns = ("workload", "cow_check", "seqs", "steps", "copies", "at alloc", "not needed", "extra vs write")
    return result_table(
        f"cow: {model}, blocks of {block_size} tokens ({kib:g} KiB each), {num_blocks} blocks, {threads} threads, "
        f"best of {repeats}",
        (*columns, "MiB copied", "KV µs/step", "copy µs/step", "total s", "identical"),
        [
            (
                row.workload,
                run.cow_check,
                str(run.sequences),
                str(run.steps),
                str(run.cow_copies),
                str(run.cow_copies_eager),
                str(run.cow_copies_unneeded),
                "-" if run is row.write else f"{row.extra_copies:+d}",
                f"{run.cow_bytes / 2**20:.2f}",
                f"{run.kv_us_per_step:.1f}",
                f"{run.copy_us_per_step:.1f}",
                f"{run.total_seconds:.2f}",
                "yes" if row.identical else "[red]NO[/red]",
            )
            for row in rows
            for run in (row.write, row.allocate)
        ],
        notes=[
            "at alloc: copies made at admission/fork (cow_check=allocate); not needed: of those, copies the request "
            "was freed before writing into; extra vs write: copies beyond write's on the same workload (also counts "
            "copies written into after their source was released, which write would have written in place)"
        ],
    )


# -- workloads ---------------------------------------------------------------------------------------------
Arrival = tuple[int, str, list[int], SamplingParams]  # (engine step, request id, prompt ids, params)


def _drain(eng: Engine, arrivals: Sequence[Arrival], on_step: Callable[[], None] | None = None) -> None:
    """Step until nothing is left: each arrival is queued at its step, and ``on_step`` runs after every step."""
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while True:
        while pending and pending[0][0] <= step:
            _, rid, ids, params = pending.pop(0)
            eng.add_request(ids, params, request_id=rid)
        if not pending and not eng.has_unfinished_requests():
            return
        eng.advance()
        if on_step is not None:
            on_step()
        step += 1
        if step > MAX_STEPS:
            raise RuntimeError("the engine made no progress")


def _run_passphrase(loaded: LoadedModel, cache: CacheConfig, sizes: CowSizes, run: CowRun) -> None:
    pset = default_passphrases()
    cfg = ExperimentConfig(trials=sizes.trials, concurrency=2, seed=sizes.seed)
    exp = Experiment(loaded, pset, cfg)
    sched = SchedulerConfig(max_model_len=min(cfg.max_model_len, default_max_model_len(loaded, cache)))
    for plan in plan_trials(pset, cfg):
        group = pset.group(plan.group)
        t0 = time.perf_counter()
        eng = Engine(loaded, cache, sched)
        meter = _Meter(eng)
        arrivals = [
            (
                r.arrival,
                r.name,
                exp.prompt_ids(group, r.prompt),
                SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True),
            )
            for r in plan.requests
        ]
        _drain(eng, arrivals)
        outputs = {f"trial {plan.index} {r.name}": eng.output(r.name) for r in plan.requests}
        run.add(eng, meter, outputs, time.perf_counter() - t0)


def _run_fork(loaded: LoadedModel, cache: CacheConfig, sizes: CowSizes, run: CowRun) -> None:
    prompts = shared_prefix_prompts(loaded, sizes.requests, seed=sizes.seed)
    stops = tuple(range(0, loaded.config.vocab_size, STOP_EVERY))
    t0 = time.perf_counter()
    eng = Engine(loaded, cache, SchedulerConfig(max_model_len=default_max_model_len(loaded, cache)))
    meter = _Meter(eng)
    arrivals = [
        (
            0,
            f"prompt {i}",
            prompt,
            SamplingParams(
                temperature=1.0, seed=sizes.seed + i, n=sizes.n, max_tokens=sizes.max_tokens, stop_token_ids=stops
            ),
        )
        for i, prompt in enumerate(prompts)
    ]
    _drain(eng, arrivals)
    run.add(eng, meter, {rid: eng.output(rid) for _, rid, _, _ in arrivals}, time.perf_counter() - t0)


def _run_chat(loaded: LoadedModel, cache: CacheConfig, sizes: CowSizes, run: CowRun) -> None:
    tok = loaded.tokenizer
    rng = random.Random(sizes.seed)
    system = tok.encode(CHAT_SYSTEM)

    def user_text(session: int, turn: int) -> list[int]:
        return tok.encode(f"\nUser {session}.{turn}: more on item {rng.randrange(1000)}?\nA:")

    t0 = time.perf_counter()
    max_len = default_max_model_len(loaded, cache)
    eng = Engine(loaded, cache, SchedulerConfig(max_model_len=max_len))
    meter = _Meter(eng)
    params = SamplingParams(temperature=0, max_tokens=sizes.max_tokens, ignore_eos=True)
    prompts = {s: system + user_text(s, 0) for s in range(sizes.sessions)}
    turn = dict.fromkeys(prompts, 0)
    live: dict[int, str] = {}

    def submit(session: int) -> None:
        live[session] = eng.add_request(prompts[session], params, request_id=f"session {session} turn {turn[session]}")

    def next_turns() -> None:
        for session, rid in list(live.items()):
            if not eng.is_finished(rid):
                continue
            del live[session]
            turn[session] += 1
            if turn[session] < sizes.turns:
                answer = list(eng.output(rid).token_ids)
                prompts[session] = prompts[session] + answer + user_text(session, turn[session])
                if len(prompts[session]) + sizes.max_tokens <= max_len:  # or the session ends here
                    submit(session)

    for s in prompts:
        submit(s)
    _drain(eng, [], next_turns)
    outputs = {f"session {s} turn {t}": eng.output(f"session {s} turn {t}") for s in prompts for t in range(turn[s])}
    run.add(eng, meter, outputs, time.perf_counter() - t0)


_RUNNERS: dict[str, Callable[[LoadedModel, CacheConfig, CowSizes, CowRun], None]] = {
    "passphrase": _run_passphrase,
    "fork": _run_fork,
    "chat": _run_chat,
}


def _mismatches(a: CowRun, b: CowRun) -> tuple[str, ...]:
    return tuple(k for k in sorted(set(a.tokens) | set(b.tokens)) if a.tokens.get(k) != b.tokens.get(k))


def _counts(run: CowRun) -> tuple:
    return (run.steps, run.cow_copies, run.cow_copies_eager, run.cow_copies_unneeded, run.cow_bytes, run.tokens)


def compare_cow_checks(
    loaded: LoadedModel,
    workloads: Sequence[str] = WORKLOADS,
    sizes: CowSizes | None = None,
    cache: CacheConfig | None = None,
    repeats: int = 1,
) -> list[CowComparison]:
    """Every workload under "write" and "allocate" on ``cache`` (default: the default pool). With ``repeats`` the
    modes take turns that many times and the fastest run of each counts. Counts and tokens must not change."""
    sizes = sizes or CowSizes()
    base = cache or CacheConfig()
    if bad := sorted(set(workloads) - set(WORKLOADS)):
        raise ValueError(f"unknown workload(s) {bad}; known: {', '.join(WORKLOADS)}")
    _warm_up(loaded, base)
    out = []
    for name in workloads:
        best: dict[str, CowRun] = {}
        for _ in range(repeats):
            for mode in COW_CHECKS:
                run = CowRun(name, mode)
                _RUNNERS[name](loaded, replace(base, cow_check=mode), sizes, run)
                prev = best.get(mode)
                if prev is not None and _counts(prev) != _counts(run):
                    raise RuntimeError(f"{name} under cow_check={mode!r} changed between repeats")
                if prev is None or run.total_seconds < prev.total_seconds:
                    best[mode] = run
        write, alloc = best["write"], best["allocate"]
        out.append(CowComparison(name, write, alloc, _mismatches(write, alloc)))
    return out


def _warm_up(loaded: LoadedModel, cache: CacheConfig) -> None:
    """One small run first, so that neither mode pays the first call's costs (kernels, allocator)."""
    eng = Engine(loaded, cache, SchedulerConfig(max_model_len=default_max_model_len(loaded, cache)))
    _drain(eng, [(0, "warm-up", list(range(1, 20)), SamplingParams(temperature=0, n=2, max_tokens=4, ignore_eos=True))])
