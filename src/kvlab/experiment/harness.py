"""The passphrase experiment: trials of concurrent requests under a sharing strategy, each request
compared with itself run alone under ``isolated``.

Every trial runs on a fresh engine (so trials are independent and a seed reproduces them exactly),
with the KV sanitizer on. A trial's plan (group, prompts, arrival steps, output lengths) depends only
on (seed, trial index), so every strategy sees the same trials and their rates compare directly.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvlab.config import KV_CACHE_DTYPES, QUANTIZATION_MODES, ModeConfig, check_choice, check_field_int
from kvlab.engine.engine import Engine
from kvlab.engine.request import RequestOutput
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.sizing import kv_rounding, storage_dtype
from kvlab.experiment.passphrases import PassphraseGroup, PassphraseSet
from kvlab.experiment.strategies import Strategy
from kvlab.instrument.attention import AttentionCapture
from kvlab.instrument.sanitizer import Violation
from kvlab.instrument.trace import Trace, TraceEvent
from kvlab.model.loader import LoadedModel

LOGIT_ATOL = 1e-3  # |logit - reference logit|; batching reorders float sums by ~1e-6, a leak moves them by >> 1e-2
EMPTY = "E"
MAX_STEPS = 2000


@dataclass(frozen=True)
class ExperimentConfig:
    trials: int = 100
    concurrency: int = 2
    seed: int = 0
    min_tokens: int = 8
    max_tokens: int = 16
    max_arrival: int = 4  # later requests arrive 1..max_arrival engine steps after the first
    block_size: int = 16
    num_blocks: int = 256
    max_model_len: int = 128
    attention_layer: int = -1  # layer whose attention is compared for contaminated requests
    # Weight-only quantised linears (``ModeConfig.quantization``) for references and trials alike. Attention is
    # captured in every run, so the engine's reference attention serves (the compiled kernel steps aside).
    quantization: str | None = None
    # The KV cache's dtype (``CacheConfig.kv_cache_dtype``) for references and trials alike: "auto", the model's.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_choice("ExperimentConfig", "quantization", self.quantization, QUANTIZATION_MODES, optional=True)
        check_choice("ExperimentConfig", "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_field_int(self, "trials", 1)
        check_field_int(self, "concurrency", 1, 26)
        check_field_int(self, "min_tokens", 1)
        check_field_int(self, "max_tokens", self.min_tokens)
        check_field_int(self, "max_arrival", 1)

    @property
    def mode(self) -> ModeConfig:
        """The engine mode every run of the experiment uses."""
        return ModeConfig(quantization=self.quantization)


@dataclass(frozen=True)
class PlannedRequest:
    name: str  # "A", "B", ... in arrival order; "E" for the injected empty request
    prompt: str
    arrival: int
    max_tokens: int


@dataclass(frozen=True)
class TrialPlan:
    index: int
    group: str
    requests: tuple[PlannedRequest, ...]


@dataclass
class Reference:
    tokens: list[int]
    logits: torch.Tensor | None  # [n, vocab]
    attention: list[torch.Tensor] = field(default_factory=list)  # [ctx] head-mean per decode step
    error: str | None = None


@dataclass
class RequestResult:
    """One request of a trial against its reference. What a person would see is told apart from what only
    the instruments see: ``output_changed`` (its greedy tokens differ from its own reference) and
    ``took_answer_of`` (they equal another request's reference instead) are visible in the answer;
    ``logits_moved`` (beyond ``LOGIT_ATOL``, tokens unchanged) and ``foreign_read`` (the sanitizer saw it
    read K/V another request wrote) are not."""

    name: str
    prompt: str
    outcome: str  # correct | contaminated | uninformative | drift (reduced precision, no foreign read)
    tokens: list[int]
    reference: list[int]
    first_divergence: int | None
    max_logit_diff: float | None
    # The request whose reference this output equals although it differs from its own; never set when the
    # two references agree over the output's length (then the answer cannot tell whose it is).
    took_answer_of: str | None = None
    polluter: str | None = None
    foreign_read: bool = False
    output_changed: bool = False
    logits_moved: bool = False
    attention_similarity: float | None = None  # to the polluter's attention, in the trial
    attention_similarity_reference: float | None = None  # the same two requests run alone


@dataclass
class TrialResult:
    index: int
    strategy: str
    group: str
    requests: list[RequestResult]
    violations: int
    root_causes: list[str]
    peak_refcount: int
    cow_copies: int
    leaked_blocks: int
    arrivals: dict[str, int]
    # Every request's reference equals the others' over their common length: no answer can show whose it is,
    # polluted or not (the near-miss group's prompts continue alike on the mini model).
    references_agree: bool = False

    @property
    def contaminated(self) -> bool:
        return any(r.outcome == "contaminated" for r in self.requests)

    @property
    def drift(self) -> bool:
        return any(r.outcome == "drift" for r in self.requests)

    @property
    def caught(self) -> bool:
        return self.violations > 0

    @property
    def took_other_answer(self) -> bool:
        return any(r.took_answer_of for r in self.requests)

    @property
    def output_changed(self) -> bool:
        return any(r.output_changed for r in self.requests)

    @property
    def logits_moved(self) -> bool:
        return any(r.logits_moved for r in self.requests)

    @property
    def polluted(self) -> list[str]:
        """The requests whose output changed, by name (arrival order: A first)."""
        return [r.name for r in self.requests if r.output_changed]

    @property
    def outputs_identical(self) -> bool:
        """Every request gave the same tokens (over their common length) although their references differ
        there: the founding document's "both outputs are the same"."""
        answers = [r for r in self.requests if r.name != EMPTY and r.tokens]
        if len(answers) < 2:
            return False
        n = min(len(r.tokens) for r in answers)
        same = len({tuple(r.tokens[:n]) for r in answers}) == 1
        return same and len({tuple(r.reference[:n]) for r in answers}) > 1

    @property
    def uninformative(self) -> bool:
        return self.references_agree


def plan_trials(passphrases: PassphraseSet, cfg: ExperimentConfig, inject_empty: bool = False) -> list[TrialPlan]:
    plans = []
    for t in range(cfg.trials):
        rng = random.Random(f"{cfg.seed}/{t}")
        group = rng.choice(passphrases.groups)
        k = cfg.concurrency
        prompts = rng.sample(group.prompts, k) if k <= len(group.prompts) else rng.choices(group.prompts, k=k)
        # The first request arrives at step 0, the others 1..max_arrival steps later: after its prefix is
        # computed (so sharing is possible) and while it still runs (outputs are >= min_tokens > max_arrival).
        arrivals = [0, *sorted(rng.randint(1, cfg.max_arrival) for _ in range(k - 1))]
        reqs = [
            PlannedRequest(chr(ord("A") + i), p, arrivals[i], rng.randint(cfg.min_tokens, cfg.max_tokens))
            for i, p in enumerate(prompts)
        ]
        empty_at = rng.randint(0, k)  # drawn even when unused, so plans agree across strategies
        if inject_empty:
            reqs.insert(empty_at, PlannedRequest(EMPTY, "", 0, cfg.max_tokens))
        plans.append(TrialPlan(t, group.name, tuple(reqs)))
    return plans


@dataclass
class _EngineRun:
    """What the engine left after one trial, before the outputs are judged against the references."""

    outputs: dict[str, RequestOutput]
    violations: list[Violation]
    peak_refcount: int
    cow_copies: int
    leaked_blocks: int
    capture: AttentionCapture


@dataclass
class TrialRecording:
    """One trial with what the HTML report draws besides its result: the block trace and the attention
    capture (layer ``Experiment.layer``) of every request."""

    result: TrialResult
    events: list[TraceEvent]
    capture: AttentionCapture


class Experiment:
    """Runs the trials of one model and passphrase set under any strategy, judging every request against
    its reference (the same request alone under ``isolated``). ``trace_sink(strategy, trial, trace)``, when
    given, receives the block trace of every trial ``run_trial`` runs."""

    def __init__(
        self,
        loaded: LoadedModel,
        passphrases: PassphraseSet,
        cfg: ExperimentConfig | None = None,
        trace_sink: Callable[[str, int, Trace], None] | None = None,
    ) -> None:
        self.loaded = loaded
        self.passphrases = passphrases
        self.cfg = cfg or ExperimentConfig()
        self.trace_sink = trace_sink
        self._refs: dict[tuple[str, str], Reference] = {}
        self.layer = self.cfg.attention_layer % loaded.config.num_layers

    # ------------------------------------------------------------------ prompts
    def prompt_ids(self, group: PassphraseGroup, prompt: str) -> list[int]:
        """The token ids a request of ``group`` sends for ``prompt``: wrapped in the model's chat template
        when the group asks for it."""
        tok = self.loaded.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if group.chat_template else prompt
        return tok.encode(text)

    def _base(self) -> tuple[dict[str, Any], dict[str, Any]]:
        c = self.cfg
        return (
            {
                "block_size": c.block_size,
                "num_blocks": c.num_blocks,
                "sanitize": True,
                "kv_cache_dtype": c.kv_cache_dtype,
            },
            {"max_model_len": c.max_model_len},
        )

    def reference(self, group: str, prompt: str) -> Reference:
        """The request run alone under ``isolated``, greedy, with logits and attention (memoised)."""
        key = (group, prompt)
        if key not in self._refs:
            self._refs[key] = self._run_alone(group, prompt)
        return self._refs[key]

    def _run_alone(self, group: str, prompt: str) -> Reference:
        if not prompt:
            return Reference([], None, error="rejected: the prompt is empty")
        cache, sched = Strategy("isolated", "", {"share_prefix": False}).configs(*self._base())
        capture = AttentionCapture(layers=[self.layer])
        eng = Engine(self.loaded, cache, sched, capture=capture, mode=self.cfg.mode)
        ids = self.prompt_ids(self.passphrases.group(group), prompt)
        rid = eng.add_request(ids, self._params(self.cfg.max_tokens))
        _drain(eng)
        out = eng.output(rid)
        att = [p.mean(0) for p in capture.decode_rows(rid, self.layer)]
        return Reference(list(out.token_ids), out.outputs[0].logits, att)

    @staticmethod
    def _params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, return_logits=True)

    # ------------------------------------------------------------------- trials
    def plans(self, strategy: Strategy) -> list[TrialPlan]:
        """The trials ``run_strategy`` runs under ``strategy``, in order: ``plans(s)[i]`` is trial ``i``."""
        return plan_trials(self.passphrases, self.cfg, strategy.inject_empty)

    def run_strategy(self, strategy: Strategy, progress: Callable[[], None] | None = None) -> list[TrialResult]:
        results = []
        for plan in self.plans(strategy):
            results.append(self.run_trial(strategy, plan))
            if progress:
                progress()
        return results

    def run_trial(self, strategy: Strategy, plan: TrialPlan) -> TrialResult:
        """Run one trial on a fresh engine and judge it; its trace goes to ``trace_sink`` if there is one."""
        sink = self.trace_sink
        trace = Trace() if sink is not None else None
        run = self._execute(strategy, plan, trace)
        if sink is not None and trace is not None:
            sink(strategy.name, plan.index, trace)
        return self._judge_trial(strategy, plan, run)

    def record_trial(self, strategy: Strategy, plan: TrialPlan) -> TrialRecording:
        """Run one trial like ``run_trial`` and keep its trace and attention capture (``trace_sink`` is not
        called). A trial depends only on its plan, so this reproduces a trial of ``run_strategy`` exactly:
        callers re-run the few trials they want to look at instead of keeping every trial's trace."""
        trace = Trace()
        run = self._execute(strategy, plan, trace)
        return TrialRecording(self._judge_trial(strategy, plan, run), list(trace.events), run.capture)

    def _execute(self, strategy: Strategy, plan: TrialPlan, trace: Trace | None) -> _EngineRun:
        cache, sched = strategy.configs(*self._base())
        cap = AttentionCapture(layers=[self.layer])
        eng = Engine(self.loaded, cache, sched, trace=trace, capture=cap, mode=self.cfg.mode)
        group = self.passphrases.group(plan.group)
        pending = sorted(plan.requests, key=lambda r: r.arrival)
        step = 0
        while pending or eng.has_unfinished_requests():
            while pending and pending[0].arrival <= step:
                r = pending.pop(0)
                ids = self.prompt_ids(group, r.prompt) if r.prompt else []
                eng.add_request(ids, self._params(r.max_tokens), request_id=r.name)
            eng.advance()
            step += 1
            if step > MAX_STEPS:
                raise RuntimeError(f"trial {plan.index} under {strategy.name} made no progress")
        return _EngineRun(
            outputs={r.name: eng.output(r.name) for r in plan.requests},
            violations=list(eng.violations),
            peak_refcount=eng.kv.stats.peak_refcount,
            cow_copies=eng.kv.stats.cow_copies,
            leaked_blocks=eng.kv.num_blocks - eng.kv.num_free_blocks(),
            capture=cap,
        )

    def _judge_trial(self, strategy: Strategy, plan: TrialPlan, run: _EngineRun) -> TrialResult:
        refs = {r.name: self.reference(plan.group, r.prompt) for r in plan.requests}
        # In reduced precision (a bf16 model, quantised linears, which run bf16 activations, or a bf16 or fp8 KV
        # cache, where K/V that differ in the last fp32 bit between batch shapes can round apart) a batched request
        # may drift from its alone run by rounding alone; only a foreign read the sanitizer saw makes that
        # divergence contamination. fp32 is the reference mode: there every divergence counts, so a blind spot
        # of the sanitizer shows up as a missed trial.
        readers = {v.reader for v in run.violations}
        dtype = self.loaded.model.dtype
        stored = storage_dtype(self.cfg.kv_cache_dtype, dtype)
        rounding = dtype != torch.float32 or self.cfg.quantization is not None or kv_rounding(stored, dtype) is not None
        results = [
            self._judge(r, run.outputs[r.name], refs, plan, drift_ok=rounding and r.name not in readers)
            for r in plan.requests
        ]
        for res in results:
            res.foreign_read = res.name in readers
            if res.outcome == "contaminated":
                res.polluter = _polluter(res.name, run.violations, res.took_answer_of)
        self._attention_similarity(run.capture, results, refs)
        return TrialResult(
            index=plan.index,
            strategy=strategy.name,
            group=plan.group,
            requests=results,
            violations=len(run.violations),
            root_causes=_root_causes(run.violations),
            peak_refcount=run.peak_refcount,
            cow_copies=run.cow_copies,
            leaked_blocks=run.leaked_blocks,
            arrivals={r.name: r.arrival for r in plan.requests},
            references_agree=_references_agree([(refs[r.name], r.max_tokens) for r in plan.requests]),
        )

    def _judge(
        self, r: PlannedRequest, out: RequestOutput, refs: dict[str, Reference], plan: TrialPlan, drift_ok: bool
    ) -> RequestResult:
        ref = refs[r.name]
        tokens = list(out.token_ids)
        want = ref.tokens[: len(tokens)]
        div = next((i for i, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b), None)
        if ref.error is not None:
            div = 0 if tokens else None
        logit_diff = None
        got_logits = out.outputs[0].logits
        if got_logits is not None and ref.logits is not None:
            n = min(len(got_logits), len(ref.logits))
            logit_diff = float((got_logits[:n] - ref.logits[:n]).abs().max()) if n else 0.0
        changed = div is not None
        moved = not changed and logit_diff is not None and logit_diff > LOGIT_ATOL
        others = {o.name: refs[o.name] for o in plan.requests if o.name != r.name}
        if not (changed or moved):
            informative = any(o.tokens[: len(tokens)] != want for o in others.values() if o.error is None)
            outcome = "correct" if informative else "uninformative"
        else:
            outcome = "drift" if drift_ok else "contaminated"
        took = None
        if changed and tokens:
            # Equal to another's reference where it differs from its own: an answer that is visibly the other's.
            took = next((n for n, o in others.items() if o.error is None and o.tokens[: len(tokens)] == tokens), None)
        return RequestResult(
            r.name,
            r.prompt,
            outcome,
            tokens,
            list(ref.tokens[: max(len(tokens), 1)]) if ref.error is None else [],
            div,
            logit_diff,
            took,
            output_changed=changed and outcome != "drift",
            logits_moved=moved and outcome != "drift",
        )

    def _attention_similarity(
        self, cap: AttentionCapture, results: list[RequestResult], refs: dict[str, Reference]
    ) -> None:
        """Cosine similarity of a contaminated request's head-mean attention (one layer) to its polluter's at
        the same point of generation (i-th decode step of each), in the trial and when both ran alone:
        reading the polluter's K/V pulls the two patterns together (the seed's observation). Both means run
        over the same decode steps: the trial's pairs end with the shorter of the two outputs, and the alone
        runs (full length) are cut there, since later steps of two diverging continuations attend less alike."""
        for res in results:
            if res.outcome != "contaminated" or not res.polluter or res.polluter == res.name:
                continue
            mine = [p.mean(0) for p in cap.decode_rows(res.name, self.layer)]
            theirs = [p.mean(0) for p in cap.decode_rows(res.polluter, self.layer)]
            pairs = list(zip(mine, theirs, strict=False))
            res.attention_similarity = _mean_cosine(pairs)
            a, b = refs[res.name].attention, refs[res.polluter].attention
            res.attention_similarity_reference = _mean_cosine(list(zip(a, b, strict=False))[: len(pairs)])


def _drain(eng: Engine) -> None:
    steps = 0
    while eng.has_unfinished_requests():
        eng.advance()
        steps += 1
        if steps > MAX_STEPS:
            raise RuntimeError("engine made no progress")


def _references_agree(refs: list[tuple[Reference, int]]) -> bool:
    """Do the references (each over its request's planned length) agree over every pair's common length?"""
    seqs = [ref.tokens[:n] for ref, n in refs if ref.error is None]
    return all(a[: len(b)] == b[: len(a)] for i, a in enumerate(seqs) for b in seqs[i + 1 :])


def _mean_cosine(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
    sims = []
    for a, b in pairs:
        n = min(len(a), len(b))
        sims.append(float(torch.nn.functional.cosine_similarity(a[:n], b[:n], dim=0)))
    return sum(sims) / len(sims) if sims else None


def _polluter(name: str, violations: list[Violation], took_answer_of: str | None) -> str | None:
    for v in violations:
        if v.reader == name and v.writer not in (None, name):
            return v.writer
    return took_answer_of


def _root_causes(violations: list[Violation], limit: int = 3) -> list[str]:
    """The first foreign read of each reader: where the contamination entered."""
    seen: set[str] = set()
    out = []
    for v in violations:
        if v.reader in seen:
            continue
        seen.add(v.reader)
        out.append(v.explain())
        if len(out) == limit:
            break
    return out


def trial_to_dict(t: TrialResult) -> dict[str, Any]:
    d = asdict(t)
    d["contaminated"] = t.contaminated
    d["caught"] = t.caught
    d["output_changed"] = t.output_changed
    d["took_other_answer"] = t.took_other_answer
    d["outputs_identical"] = t.outputs_identical
    d["polluted"] = t.polluted
    return d
