"""vLLM's sampling parameters, each checked against the dense oracle (same weights, no cache)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import LLM, SamplingParams
from kvlab.engine.sampling import InvalidRequestError
from kvlab.model import dense_logits
from oracle_cache import mini, oracle

PROMPT = tuple(b"The passphrase of the day is")
GREEDY = {"temperature": 0, "ignore_eos": True}


def _one(**kw) -> object:
    return LLM(mini()).generate([list(PROMPT)], SamplingParams(**kw), use_tqdm=False)[0]


def _dense_logprobs(ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(dense_logits(mini().model, ids).double(), dim=-1)


def test_logprobs_equal_the_oracles_log_softmax() -> None:
    out = _one(max_tokens=6, logprobs=3, **GREEDY)
    ref = list(oracle("mini", PROMPT, 6))
    assert out.token_ids == ref
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 6
    total = 0.0
    for j, (tok, step) in enumerate(zip(ref, c.logprobs, strict=True)):
        lp = _dense_logprobs(list(PROMPT) + ref[:j])[-1]
        top = torch.topk(lp, 3)
        assert list(step)[:3] == top.indices.tolist()
        for t, entry in step.items():
            assert math.isclose(entry.logprob, float(lp[t]), abs_tol=1e-4)
            assert entry.rank == int((lp > lp[t]).sum()) + 1
            assert entry.decoded_token == bytes([t]).decode("utf-8", "replace") if t < 256 else True
        assert step[tok].rank == 1  # greedy took the most likely token
        total += step[tok].logprob
    assert math.isclose(c.cumulative_logprob or 0.0, total, abs_tol=1e-9)


def test_prompt_logprobs_equal_the_oracles() -> None:
    llm = LLM(mini())
    llm.generate([list(PROMPT)], SamplingParams(max_tokens=1, **GREEDY))  # cache the prefix: still computed
    out = llm.generate([list(PROMPT)], SamplingParams(max_tokens=1, prompt_logprobs=2, **GREEDY))[0]
    assert out.num_cached_tokens > 0
    pl = out.prompt_logprobs
    assert pl is not None and pl[0] is None and len(pl) == len(PROMPT)
    lp = _dense_logprobs(list(PROMPT))
    for pos in range(1, len(PROMPT)):
        entry = pl[pos]
        assert entry is not None
        assert math.isclose(entry[PROMPT[pos]].logprob, float(lp[pos - 1, PROMPT[pos]]), abs_tol=1e-4)
        assert len(entry) in (2, 3)  # top-2 plus the actual token when it is not among them


def test_stop_string_matches_across_tokens_and_is_cut() -> None:
    ref = list(oracle("mini", PROMPT, 16))
    # Two printable ASCII bytes in a row (two tokens of the byte tokenizer) that do not occur earlier.
    j = next(
        j
        for j in range(1, 14)
        if all(32 <= t < 127 for t in ref[j : j + 2]) and bytes(ref[j : j + 2]) not in bytes(ref[: j + 1])
    )
    stop = bytes(ref[j : j + 2]).decode()
    decode = LLM(mini()).get_tokenizer().decode
    out = _one(max_tokens=16, stop=[stop], **GREEDY)
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == decode(ref[:j])
    assert out.token_ids == ref[: j + 2]  # the tokens that completed the stop string are kept, as vLLM does
    kept = _one(max_tokens=16, stop=stop, include_stop_str_in_output=True, **GREEDY)
    assert kept.text == decode(ref[: j + 2])


def test_stop_token_ids_and_min_tokens() -> None:
    ref = list(oracle("mini", PROMPT, 8))
    out = _one(max_tokens=8, stop_token_ids=[ref[2]], **GREEDY)
    assert out.token_ids == ref[:3] and out.outputs[0].stop_reason == ref[2]
    held = _one(max_tokens=8, stop_token_ids=[ref[2]], min_tokens=4, **GREEDY)
    assert held.token_ids[:2] == ref[:2]
    assert held.token_ids[2] != ref[2]  # masked while fewer than min_tokens are out
    assert len(held.token_ids) >= 4


def _penalised_greedy(n: int, rep: float = 1.0, freq: float = 0.0, pres: float = 0.0) -> list[int]:
    """The oracle with vLLM's penalty formulas applied by hand."""
    ids, out = list(PROMPT), []
    for _ in range(n):
        x = dense_logits(mini().model, ids + out)[-1].double()
        seen = sorted(set(ids) | set(out))
        s = x[seen]
        x[seen] = torch.where(s > 0, s / rep, s * rep)
        if out:
            counts = torch.bincount(torch.tensor(out), minlength=x.numel())
            x -= freq * counts + pres * (counts > 0)
        out.append(int(torch.argmax(x)))
    return out


@pytest.mark.parametrize(("rep", "freq", "pres"), [(1.8, 0.0, 0.0), (1.0, 1.5, 0.0), (1.0, 0.0, 2.0), (1.3, 0.5, 0.5)])
def test_penalties_follow_vllms_formulas(rep: float, freq: float, pres: float) -> None:
    out = _one(max_tokens=10, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres, **GREEDY)
    assert out.token_ids == _penalised_greedy(10, rep, freq, pres)


def test_logit_bias_min_p_and_top_k_off() -> None:
    forced = _one(max_tokens=4, logit_bias={ord("Z"): 100}, **GREEDY)
    assert forced.token_ids == [ord("Z")] * 4
    ref = list(oracle("mini", PROMPT, 6))
    # min_p = 1 keeps only the most likely token: sampling is greedy whatever the seed.
    assert _one(max_tokens=6, temperature=1.0, min_p=1.0, seed=3, ignore_eos=True).token_ids == ref
    assert SamplingParams(top_k=-1).top_k == 0
    for bad in ({"min_p": 1.5}, {"presence_penalty": 3}, {"repetition_penalty": 0}, {"logprobs": 21},
                {"min_tokens": 5, "max_tokens": 4}, {"stop": [""]}, {"logit_bias": {1: float("nan")}}):  # fmt: skip
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    bad_bias = LLM(mini()).generate([list(PROMPT)], SamplingParams(logit_bias={10**6: 1.0}))[0]
    assert bad_bias.finish_reason == "error" and "outside" in (bad_bias.error or "")


def test_llm_speaks_vllms_front_end() -> None:
    llm = LLM("mini", dtype="float32", enable_prefix_caching=False)
    assert llm.engine.cache_config.share_prefix is False
    assert llm.get_tokenizer() is llm.tokenizer
    by_text = llm.generate({"prompt": bytes(PROMPT).decode()}, SamplingParams(max_tokens=4, **GREEDY))[0]
    by_ids = llm.generate([{"prompt_token_ids": list(PROMPT)}], SamplingParams(max_tokens=4, **GREEDY))[0]
    assert by_text.token_ids == by_ids.token_ids == list(oracle("mini", PROMPT, 4))
    conv = [{"role": "user", "content": "hi"}]
    chat = llm.chat(conv, SamplingParams(max_tokens=3, **GREEDY))[0]
    assert chat.prompt_token_ids == llm.tokenizer.encode(llm.tokenizer.apply_chat_template(conv))
    assert len(llm.chat([conv, conv], SamplingParams(max_tokens=2, **GREEDY))) == 2
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM("mini", dtype="float8")
    assert LLM("mini", dtype="bfloat16").model.model.dtype == torch.bfloat16


def test_max_tokens_none_is_servable_when_the_pool_bounds_the_context() -> None:
    """Regression: max_model_len defaulted to the whole pool while admission keeps one copy-on-write block
    spare, so with the pool as the bound (SmolLM2's default) every max_tokens=None request was refused."""
    llm = LLM(mini(), num_blocks=8, block_size=16)
    assert llm.engine.scheduler_config.max_model_len == 7 * 16
    out = llm.generate([list(PROMPT)], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert out.error is None and out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == 7 * 16


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_row_with_one_non_finite_logit_fails_alone(bad: float) -> None:
    """Finiteness is read from each row's amax and amin (NaN propagates through both): one bad entry anywhere
    in a row fails that row, and the rows around it are sampled as if it were not there."""
    from kvlab.engine.sampling import sample

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[1, 37] = bad
    greedy = SamplingParams(temperature=0)
    out = sample(logits, [greedy] * 3, [None] * 3)
    assert set(out.errors) == {1} and "non-finite logits" in out.errors[1]
    assert out.tokens[0] == int(logits[0].argmax()) and out.tokens[2] == int(logits[2].argmax())
    assert out.tokens[1] is None


def _full_vocabulary_distribution(scaled: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The sampling distribution as masks over the whole vocabulary (the rule sampling_distribution must keep)."""
    probs = torch.softmax(scaled, dim=-1)
    if p.min_p:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_k:
        kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
        probs = probs.masked_fill(scaled < kth, 0.0)  # ties with the k-th token kept
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p * sorted_probs.sum()
        drop[0] = False
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs / probs.sum()


@given(
    logits=st.lists(st.integers(-6, 6), min_size=2, max_size=40),  # small integers: many ties
    top_k=st.integers(0, 45),
    # Not a mass the tied tokens can sum to exactly: at such a boundary either side of the rounding is right.
    top_p=st.sampled_from([1.0, 0.93, 0.47, 0.13]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
)
@settings(max_examples=300, deadline=None)
def test_top_k_candidates_carry_the_whole_vocabulary_distribution(
    logits: list[int], top_k: int, top_p: float, min_p: float
) -> None:
    """Sampling works on the top_k candidates only (ties with the k-th included); the distribution it draws from
    is the full-vocabulary one, token for token, within float64 rounding."""
    from kvlab.engine.sampling import sampling_distribution

    scaled = torch.tensor(logits, dtype=torch.float64) / 1.5
    p = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    candidates, weights = sampling_distribution(scaled, p)
    got = torch.zeros_like(scaled)
    got[candidates if candidates is not None else slice(None)] = weights / weights.sum()
    assert torch.allclose(got, _full_vocabulary_distribution(scaled, p), rtol=0, atol=1e-12)
    if 0 < top_k < len(logits):  # the work runs on the candidates: the top_k and every token tied with the k-th
        kth = torch.topk(scaled, top_k).values[-1]
        assert candidates is not None and candidates.tolist() == (scaled >= kth).nonzero().squeeze(1).tolist()
        assert weights.numel() == candidates.numel()
    else:
        assert candidates is None and weights.numel() == len(logits)


_ROW = st.fixed_dictionaries(
    {
        "top_k": st.integers(0, 45),
        # the shortlist's whole range, its edge, and past it (the row-by-row path: there the division may tie)
        "temperature": st.sampled_from([0.0, 2e-5, 0.7, 1.0, 3.0, 1e6, 1e300]),
        "top_p": st.sampled_from([1.0, 0.93, 0.47]),
        "min_p": st.sampled_from([0.0, 0.05]),
        "seed": st.integers(0, 2**31),
    }
)


@given(
    rows=st.lists(_ROW, min_size=1, max_size=6),
    vocab=st.integers(2, 40),
    scale=st.sampled_from([1.0, 1.5e-3, 3e2, 1e-44]),  # 1e-44: fp32 denormal steps, which a division could tie
    data=st.data(),
)
@settings(max_examples=300, deadline=None)
def test_a_batch_samples_each_row_as_the_row_alone_would(
    rows: list[dict], vocab: int, scale: float, data: st.DataObject
) -> None:
    """``sample`` finds the top_k candidates of a batch's rows together (``top_k_shortlists``); every row's token is
    the one ``sample_row`` draws for it alone, on its float64 logits over the temperature, with a generator of the
    same seed: the same candidates, weights and draw, for ties, any top_k, tiny and huge temperatures. Each
    generator is left where the row alone leaves it (a single candidate is not drawn but still advances it), so a
    seeded request's later draws do not depend on how its earlier ones were found."""
    from kvlab.engine.sampling import sample, sample_row

    ints = data.draw(st.lists(st.lists(st.integers(-6, 6), min_size=vocab, max_size=vocab), min_size=len(rows),
                              max_size=len(rows)))  # fmt: skip
    logits = torch.tensor(ints, dtype=torch.float32) * scale
    params = [SamplingParams(**r) for r in rows]
    generators = [torch.Generator().manual_seed(r["seed"]) for r in rows]
    got = sample(logits, params, generators)
    for i, (r, p) in enumerate(zip(rows, params, strict=True)):
        gen = torch.Generator().manual_seed(r["seed"])
        alone = int(logits[i].argmax()) if p.greedy else sample_row(logits[i].double() / p.temperature, p, gen)
        assert got.tokens[i] == alone, (i, r)
        assert torch.equal(generators[i].get_state(), gen.get_state()), (i, r)


def test_a_batch_under_top_k_makes_one_pass_over_the_vocabulary(monkeypatch) -> None:
    """64 rows at top_k 1 to 3 (W16 n = 4): one ``topk`` for the batch, not one per row. A row asking for a top_k
    past ``SHORTLIST_MAX_K`` pays for its own ``topk`` and does not widen the batch's (one request would slow every
    row of its step)."""
    from kvlab.engine.sampling import sample

    calls: list[tuple[tuple[int, ...], int]] = []
    real = torch.topk

    def counting(x: torch.Tensor, k: int, *args, **kw):  # type: ignore[no-untyped-def]
        calls.append((tuple(x.shape), k))
        return real(x, k, *args, **kw)

    monkeypatch.setattr(torch, "topk", counting)
    logits = torch.randn(65, 1000, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, top_k=1 + i % 3, seed=i) for i in range(64)]
    params.append(SamplingParams(temperature=1.0, top_k=999, seed=64))
    out = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(65)])
    assert calls == [((64, 1000), 4), ((1000,), 999)]
    assert out.tokens[0] == int(logits[0].argmax()) and not out.errors


def test_the_batchs_argmax_runs_only_for_plain_greedy_rows() -> None:
    """The greedy rows' argmax is one pass over every row's vocabulary: a batch without a plain greedy row (W16
    n = 4 samples at top_k 1) makes none; one greedy row among sampled ones makes one, and gets the argmax."""
    from kvlab.engine.sampling import sample

    calls: list[int] = []

    def counting(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return torch.argmax(x, dim=-1)

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    sampled = [SamplingParams(temperature=1.0, top_k=1 + i % 2, seed=i) for i in range(4)]
    out = sample(logits, sampled, [torch.Generator().manual_seed(i) for i in range(4)], argmax=counting)
    assert calls == [] and not out.errors and all(t is not None for t in out.tokens)
    mixed = [*sampled[:3], SamplingParams(temperature=0.0)]
    out = sample(logits, mixed, [torch.Generator().manual_seed(i) for i in range(4)], argmax=counting)
    assert calls == [4] and out.tokens[3] == int(logits[3].argmax())


# ------------------------------------------------------------------ vLLM's extra fields (allowed ids, bad words, ...)
def _masked_greedy(prompt: tuple[int, ...], steps: int, mask) -> list[int]:  # type: ignore[no-untyped-def]
    """The dense oracle's greedy tokens with ``mask(output so far, logits row)`` applied before each argmax."""
    out: list[int] = []
    for _ in range(steps):
        row = dense_logits(mini().model, list(prompt) + out, last_only=True)[-1].double()
        out.append(int(torch.argmax(mask(out, row.clone()))))
    return out


def test_allowed_token_ids_pick_the_oracles_best_among_them() -> None:
    allowed = [5, 60, 66, 120, 200]

    def only_allowed(_: list[int], row: torch.Tensor) -> torch.Tensor:
        keep = torch.full_like(row, -math.inf)
        keep[allowed] = row[allowed]
        return keep

    out = _one(max_tokens=6, allowed_token_ids=allowed, **GREEDY)
    assert out.token_ids == _masked_greedy(PROMPT, 6, only_allowed) and set(out.token_ids) <= set(allowed)


def test_bad_words_ban_their_last_token_after_the_rest_of_them() -> None:
    """The oracle's continuation starts 253, 4, '<', 'B': with the bad word "<B" (tokens 60 66, and 32 60 66
    after a space, as vLLM tokenises it) 'B' cannot follow '<', and the rest follows the dense model."""
    ref = oracle("mini", PROMPT, 8)
    assert ref[2:4] == (60, 66)

    def no_lt_b(out: list[int], row: torch.Tensor) -> torch.Tensor:
        if out[-1:] == [60] or out[-2:] == [32, 60]:
            row[66] = -math.inf
        return row

    expected = _masked_greedy(PROMPT, 8, no_lt_b)
    out = _one(max_tokens=8, bad_words=["<B"], **GREEDY)
    assert out.token_ids == expected and expected[:3] == list(ref[:3]) and expected[3] != 66

    def no_lt(_: list[int], row: torch.Tensor) -> torch.Tensor:
        row[60] = -math.inf
        return row

    single = _one(max_tokens=8, bad_words=["<"], **GREEDY)  # one token: banned everywhere
    assert single.token_ids == _masked_greedy(PROMPT, 8, no_lt) and 60 not in single.token_ids


def test_truncate_prompt_tokens_keeps_the_last_k() -> None:
    out = _one(max_tokens=5, truncate_prompt_tokens=7, **GREEDY)
    assert out.prompt_token_ids == list(PROMPT[-7:])
    assert out.token_ids == list(oracle("mini", PROMPT[-7:], 5))


def test_detokenize_off_gives_tokens_and_no_text() -> None:
    out = _one(max_tokens=5, detokenize=False, **GREEDY)
    assert out.token_ids == list(oracle("mini", PROMPT, 5)) and out.outputs[0].text == ""
    with pytest.raises(InvalidRequestError, match="detokenize must be True when stop strings are given"):
        SamplingParams(detokenize=False, stop=["x"])


@pytest.mark.parametrize(
    "kw, rule",
    [
        ({"allowed_token_ids": []}, "allowed_token_ids must be None or a non-empty list of token ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids must be None or a non-empty list"),
        ({"bad_words": [""]}, "bad_words must be a list of non-empty strings"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be None or an int >= 1"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens must be True or False"),
    ],
)
def test_the_extra_fields_are_validated(kw: dict, rule: str) -> None:
    with pytest.raises(InvalidRequestError, match=rule):
        SamplingParams(**kw)


def test_an_allowed_id_outside_the_vocabulary_is_refused_and_others_finish() -> None:
    llm = LLM(mini())
    good = llm.engine.add_request(list(PROMPT), SamplingParams(max_tokens=3, **GREEDY))
    with pytest.raises(InvalidRequestError, match="outside"):
        llm.engine.add_request(list(PROMPT), SamplingParams(allowed_token_ids=[10**6]))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.output(good).token_ids == list(oracle("mini", PROMPT, 3))
