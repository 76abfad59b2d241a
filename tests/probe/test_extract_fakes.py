"""The strategies of `kvlab probe --extract` (kvlab.probe.attacks) against fake prefix caches: a toy BPE
tokenizer (several characters a token, merges across the prefix/secret boundary), exact or block reporting,
shared or per-sender caches. The live kvlab servers are in tests/server/test_extract_strategies.py."""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from kvlab.probe.attacks.base import ExtractConfig, ExtractReport, Prompt, Ranked, Reply
from kvlab.probe.attacks.dictionary import aligned_prefix, boundary_keys, candidate_count
from kvlab.probe.attacks.membership import binomial_tail
from kvlab.probe.attacks.priors import order_candidates, string_prior
from kvlab.probe.attacks.tokenizers import LocalTokenizer, TokenizerAccess
from kvlab.probe.attacks.tokens import consistent, stable_known
from kvlab.probe.attacks.traffic import parse_top_logprobs
from kvlab.probe.extract import extract


class ToyBpe:
    """Greedy longest match over single characters (id = code point) and a few merges: like BPE, a secret's
    tokens are often several characters, and the space before it merges with its first letters."""

    bos_token_id = 127  # not a piece: what a server may put before every text prompt
    MERGES = ("ab", "abc", "cd", "ba", "dd", "bad", " a", " ab", " b", " c", " d", " cd", "Internal", " note", "is")
    vocab_size = 128 + len(MERGES)

    def __init__(self) -> None:
        self.pieces = {i: chr(i) for i in range(32, 127)} | {128 + j: m for j, m in enumerate(self.MERGES)}
        self.ids = {text: i for i, text in self.pieces.items()}
        self.longest = max(map(len, self.ids))

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            for n in range(min(self.longest, len(text) - i), 0, -1):
                if text[i : i + n] in self.ids:
                    out.append(self.ids[text[i : i + n]])
                    i += n
                    break
            else:
                raise ValueError(f"no token for {text[i]!r}")
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.pieces.get(i, "") for i in ids)


class Trie:
    """Every prompt a namespace's cache holds, as a trie of token ids: the longest cached prefix in one walk."""

    def __init__(self) -> None:
        self.root: dict[int, dict] = {}  # type: ignore[type-arg]

    def match(self, ids: Sequence[int]) -> int:
        node, n = self.root, 0
        for t in ids:
            if t not in node:
                break
            node, n = node[t], n + 1
        return n

    def insert(self, ids: Sequence[int]) -> None:
        node = self.root
        for t in ids:
            node = node.setdefault(t, {})


@dataclass
class TokenCache:
    """A prefix cache over token ids: a prompt hits its longest common prefix with an earlier prompt of its
    namespace (all but its last token at most), reported exactly or rounded down to blocks."""

    tok: ToyBpe | None = None  # None: one token a byte
    report: str = "exact"  # exact | block
    block: int = 16
    shared: bool = True
    bos: bool = False  # text prompts start with the tokenizer's BOS, which its encode() leaves out (llama.cpp)
    tries: dict[str, Trie] = field(default_factory=lambda: defaultdict(Trie))
    victim: list[list[int]] = field(default_factory=list)  # the victim's prompts, as ids
    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def ids(self, prompt: Prompt) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        ids = self.tok.encode(prompt) if self.tok is not None else list(prompt.encode())
        return [ToyBpe.bos_token_id, *ids] if self.bos else ids

    def send(self, who: str, prompt: Prompt) -> Reply:
        ids = self.ids(prompt)
        trie = self.tries["all" if self.shared else who]
        hit = min(trie.match(ids), len(ids) - 1)
        trie.insert(ids)
        self.sent[who] += 1
        if who == "victim":
            self.victim.append(ids)
        cached = hit if self.report == "exact" else hit // self.block * self.block
        return Reply(cached, len(ids), 0.01)


@dataclass
class Sender:
    cache: TokenCache
    who: str

    def send(self, prompt: Prompt) -> Reply:
        return self.cache.send(self.who, prompt)


def run(cache: TokenCache, ranker: object = None, **kw: object) -> ExtractReport:
    cfg = ExtractConfig(**{"alphabet": "abcd", "secret_length": (8, 8), "seed": 5, **kw})  # type: ignore[arg-type]
    tok = TokenizerAccess(local=LocalTokenizer(cache.tok, "toy")) if cache.tok is not None else None
    return extract(
        Sender(cache, "attacker"),
        Sender(cache, "victim"),
        cfg,
        tokenizer=tok,
        ranker=ranker,  # type: ignore[arg-type]
    )


# ------------------------------------------------------------------ pure pieces
def test_candidate_tokens_continue_the_prefix_with_the_alphabet() -> None:
    prefix = "code: "
    assert consistent(prefix, "abcd", 8, 5, " ab")  # the prefix's last space, then secret letters
    assert consistent(prefix, "abcd", 8, 5, " ")  # the rest of the prefix alone
    assert not consistent(prefix, "abcd", 8, 5, "ab")  # skips the space
    assert not consistent(prefix, "abcd", 8, 6, "ax")  # a letter outside the alphabet
    assert consistent(prefix, "abcd", 8, 12, "ab") and not consistent(prefix, "abcd", 8, 12, "abc")  # 6 + 3 > 8
    vocab = {1: "a", 2: "abc", 3: "ab", 4: "b"}
    assert order_candidates([1, 2, 3, 4], vocab, [], []) == [1, 4, 3, 2]  # shortest first, then by id
    assert order_candidates([1, 2, 3, 4], vocab, [4, 9, 1], []) == [4, 1, 3, 2]  # the server's likeliest first
    # Then the mean of the priors (a missing one left out), ties as without.
    assert order_candidates([1, 2, 3, 4], vocab, [4], [{2: 0.6, 3: 0.2}, {}]) == [4, 2, 3, 1]
    assert order_candidates([1, 2, 3, 4], vocab, [], [{2: 0.5}, {3: 0.9}]) == [3, 2, 1, 4]


def test_the_string_prior_is_the_tokenizers_view_of_a_random_secret() -> None:
    """Sampled random continuations, tokenized: the next token's frequencies; a continuation that re-merges the
    known part is not counted."""
    toy = ToyBpe()
    access = TokenizerAccess(local=LocalTokenizer(toy, "toy"))
    known = stable_known(access, "x is: ", "abcd")
    assert known is not None
    prior = string_prior(access.encode_offline, known, "x is: ", "abcd", [8], random.Random(0), samples=2000)
    assert abs(sum(prior.values()) - 1) < 1e-9
    pieces = {toy.decode([t]): p for t, p in prior.items()}
    # A random 8-letter secret after "x is: " starts " ab" (then c? "abc" is no merge after a space) with
    # P(a)P(b) = 1/16 ... " a" with P(a)(1 - P(b)), " b", " c", " d" with 1/4 each, " cd" with 1/16.
    assert set(pieces) == {" a", " ab", " b", " c", " d", " cd"}
    assert abs(pieces[" b"] - 0.25) < 0.04 and abs(pieces[" ab"] - 1 / 16) < 0.02 and abs(pieces[" c"] - 3 / 16) < 0.03


def test_the_known_part_stops_before_tokens_a_secret_can_remerge() -> None:
    toy = ToyBpe()
    access = TokenizerAccess(local=LocalTokenizer(toy, "toy"))
    known = stable_known(access, "x is: ", "abcd")
    assert known is not None and toy.decode(known) == "x is:"  # " a", " b", ... merge the trailing space
    vocab = access.vocabulary()
    assert vocab is not None and vocab[128 + ToyBpe.MERGES.index(" ab")] == " ab"


def test_dictionary_pieces() -> None:
    assert list(boundary_keys([1, 2, 3, 4, 5, 6], 1, 2)) == [(2,), (2, 3, 4), (2, 3, 4, 5, 6)]
    prefix = aligned_prefix("[x] The code is: ", "1234", 16, len)
    assert (len(prefix) + 4) % 16 == 0 and len(prefix) >= 16 and prefix.endswith(": ")
    pins = ExtractConfig(alphabet="0123456789", secret_length=(4, 4))
    assert candidate_count(pins) == 10_000
    assert binomial_tail(3, 3, 1 / 8) == pytest.approx(1 / 512) and binomial_tail(0, 3, 0.5) == 1.0


def test_logprobs_in_both_shapes() -> None:
    legacy = {"tokens": ["a"], "top_logprobs": [{"a": -0.5, "b": -0.1, "c": -3.0}]}
    assert parse_top_logprobs(legacy, 7) == Ranked(7, ((None, "b"), (None, "a"), (None, "c")))
    llama = {"content": [{"id": 5, "token": "x", "top_logprobs": [{"id": 5, "token": "x", "logprob": -0.2}]}]}
    assert parse_top_logprobs(llama) == Ranked(5, ((5, "x"),))
    assert parse_top_logprobs(None) is None and parse_top_logprobs({"top_logprobs": []}) is None


def test_strategy_options_are_validated() -> None:
    for bad in (
        {"strategy": "guess"},
        {"dictionary": ("1234",)},  # one entry
        {"dictionary": ("12", "12")},
        {"dictionary": ("12", "34"), "secret": "56"},
        {"candidates": ("a b", "c d"), "dictionary": ("12", "34")},
        {"strategy": "token", "dictionary": ("12", "34")},
        {"strategy": "membership", "dictionary": ("12", "34")},
        {"decoys": 0},
    ):
        with pytest.raises(ValueError):
            ExtractConfig(**bad).validate()  # type: ignore[arg-type]
    ExtractConfig(dictionary=("Ann", "Bob"), secret="Bob").validate()  # a dictionary secret needs no alphabet


# ------------------------------------------------------------------ token
def test_token_strategy_recovers_a_bpe_secret_that_characters_cannot() -> None:
    cache = TokenCache(ToyBpe())
    r = run(cache)
    assert r.strategy == "token" and r.unit == "tokens" and r.granularity == 1
    assert r.verdict == "leak" and r.recovered == r.secret and r.correct_chars == 8
    assert r.tokens_recovered < 8  # several characters a token
    assert r.requests_per_token is not None and r.requests_per_token <= len(ToyBpe.MERGES) + 4
    # Character guesses on the same server do not line up with its tokens: nothing recovered, and no claim of
    # safety either (its calibration may even fit by chance: the toy's merges are rare in random text).
    for seed in range(4):
        char = run(TokenCache(ToyBpe()), strategy="char", seed=seed)
        assert char.strategy == "char" and char.correct_chars == 0 and char.verdict == "inconclusive"


def test_the_servers_likeliest_token_is_guessed_first() -> None:
    """A ranker that knows the victim's next token: one guess a step (plus the logprobs request)."""
    cache = TokenCache(ToyBpe())
    plain = run(TokenCache(ToyBpe()))

    def ranker(prompt: Prompt) -> Ranked | None:
        ids = cache.ids(prompt)
        right = [v for v in cache.victim if v[: len(ids)] == ids and len(v) > len(ids)]
        return Ranked(None, ((right[0][len(ids)] if right else 0, ""),))

    r = run(cache, ranker=ranker)
    assert r.recovered == r.secret and r.verdict == "leak"
    assert all(s.tried == 1 for s in r.steps if s.outcome == "recovered")
    # Without the server's ranking the priors order the guesses: more of them than one a step.
    assert sum(s.tried for s in r.steps) < sum(s.tried for s in plain.steps)


def test_a_server_that_caches_the_generated_token_gets_the_fixed_order() -> None:
    """Its logprobs request would cache known + [top]: guessing the top token first would hit the attacker's own
    request. The probe finds out (two requests) and guesses in the fixed order."""

    class Caching(TokenCache):
        def generate(self, prompt: Prompt) -> Ranked:
            self.tries["all"].insert([*self.ids(prompt), 65])  # the token "A", which no candidate is
            return Ranked(65, ((65, "A"),))

    cache = Caching(ToyBpe())
    r = run(cache, ranker=cache.generate)
    assert any("caches the token a logprobs request generates" in n for n in r.notes), r.notes
    assert r.recovered == r.secret


def test_token_id_guesses_start_with_the_bos_a_server_adds_to_text_prompts() -> None:
    """llama.cpp and vLLM put BOS before a text prompt's tokens, while /tokenize (as the probe asks it) leaves
    it out: guesses without it would never line up with the victim's prompt."""
    r = run(TokenCache(ToyBpe(), bos=True))
    assert any("starts every text prompt with token(s) [127]" in n for n in r.notes), r.notes
    assert r.strategy == "token" and r.verdict == "leak" and r.recovered == r.secret


def test_token_ids_that_do_not_line_up_with_text_prompts_claim_no_safety() -> None:
    """The same server, but nothing tells the probe which token it adds (no server /tokenize, a local copy
    without a BOS): its token-id copy of its own text prompt misses, so no guess hitting proves nothing."""
    toy = ToyBpe()
    toy.bos_token_id = None  # type: ignore[assignment]
    cache = TokenCache(toy, bos=True)
    r = run(cache)
    assert r.strategy == "token" and r.recovered == "" and r.verdict == "inconclusive"
    assert "do not line up" in r.reason and any("could not tell which" in n for n in r.notes)


def test_token_strategy_across_namespaces_and_on_blocks() -> None:
    r = run(TokenCache(ToyBpe(), shared=False))
    assert r.strategy == "token" and r.verdict == "no leak" and r.recovered == "" and r.prefix_visible is False
    blocks = run(TokenCache(ToyBpe(), report="block"), strategy="token")
    assert blocks.granularity == 16 and blocks.steps[-1].outcome == "unreachable" and blocks.verdict == "inconclusive"


# ------------------------------------------------------------------ dictionary
def test_auto_falls_back_to_membership_where_the_secret_is_out_of_reach_on_bpe_blocks() -> None:
    """4^8 secrets do not fit the request budget: the victim's exact prompt is still found cached (a leak), and
    the reason says what the secret itself would cost. Forced, the dictionary says it is out of reach."""
    r = run(TokenCache(ToyBpe(), report="block"), max_requests=5000)
    assert r.strategy == "membership" and "out of reach within --max-requests 5000" in r.strategy_reason
    assert r.verdict == "leak" and "recovering the secret itself among its 65,536 candidates" in r.reason
    forced = run(TokenCache(ToyBpe(), report="block"), strategy="dictionary", max_requests=5000)
    assert forced.strategy == "dictionary" and forced.candidates == 4**8
    assert forced.steps[-1].outcome == "unreachable" and forced.verdict == "inconclusive" and forced.recovered == ""
    assert "out of reach" in forced.reason and "--max-requests 5000" in forced.reason


def test_membership_candidates_run_a_block_past_the_secret() -> None:
    """vLLM's CPU blocks are 128 tokens, longer than the generated candidates' note (about 4 characters a token
    in SmolLM2's BPE): no block held the secret whole, and every candidate said nothing (INCONCLUSIVE on vLLM
    0.32). The note now runs at least a block past the secret."""
    from types import SimpleNamespace

    from kvlab.probe.attacks.membership import candidate_rounds

    cfg = ExtractConfig(alphabet="abcd", secret_length=(8, 8), membership_rounds=2, decoys=3)
    run_ = SimpleNamespace(cfg=cfg, report=SimpleNamespace(secret="abcdabcd"), run_id="r")

    def count(text: str) -> int:
        return len(text) // 4

    for block in (16, 128, 256):
        for prompts, _, _ in candidate_rounds(run_, random.Random(0), count, block):  # type: ignore[arg-type]
            for p in prompts:
                after = p[p.index("is: ") + 4 + 8 :]  # past the 8-character secret
                assert count(after) >= block, (block, count(after))


@pytest.mark.parametrize("tok", [None, ToyBpe()], ids=["bytes", "bpe"])
def test_a_four_digit_pin_is_recovered_through_blocks(tok: ToyBpe | None) -> None:
    cache = TokenCache(tok, report="block")
    r = run(cache, strategy="dictionary", alphabet="0123456789", secret_length=(4, 4), max_candidates=10_000)
    assert r.strategy == "dictionary" and r.verdict == "leak" and r.recovered == r.secret
    assert r.chance == 1 / 10_000 and r.requests_to_recover is not None
    assert r.steps[0].tried <= 10_000


def test_a_name_from_a_list_is_recovered_or_narrowed_to_the_names_it_starts() -> None:
    """Names of several lengths, one a prefix of two others. The layout puts the secret's end on a block
    boundary: a hit on a name keeps only the names it starts. The longest of the three is told apart (its
    boundary passes the others' ends); the shortest is not (nothing of the longer ones past it fills a block),
    and the report says so: narrowed to the three."""
    rng = random.Random(0)
    names = sorted({"".join(rng.choice("bcdfgklmnprst") + rng.choice("aeiou") for _ in range(3)) for _ in range(800)})
    names += [names[0] + "a", names[0] + "ana"]
    for secret in (names[7], names[0] + "ana"):
        r = run(TokenCache(None, report="block"), dictionary=tuple(names), secret=secret, max_candidates=1000)
        assert r.strategy == "dictionary" and r.recovered == secret and r.verdict == "leak", r.reason
        assert r.chance == 1 / len(names)
    r = run(TokenCache(None, report="block"), dictionary=tuple(names), secret=names[0], max_candidates=1000)
    assert r.steps[0].outcome == "ambiguous" and r.recovered == "" and r.verdict == "leak"
    assert r.chance == 3 / len(names) and "narrowed the secret to 3" in r.reason


def test_dictionary_across_namespaces_and_with_a_silent_victim() -> None:
    pins = {"strategy": "dictionary", "alphabet": "0123456789", "secret_length": (3, 3), "max_candidates": 1000}
    r = run(TokenCache(None, report="block", shared=False), **pins)  # type: ignore[arg-type]
    assert r.verdict == "no leak" and r.recovered == "" and r.steps[0].tried == 1000

    class Silent(Sender):
        def send(self, prompt: Prompt) -> Reply:
            return Reply(0, 1, 0.01) if self.who == "victim" else super().send(prompt)

    cache = TokenCache(None, report="exact")
    cfg = ExtractConfig(alphabet="0123456789", secret_length=(3, 3), seed=1, strategy="dictionary", max_candidates=1000)
    r = extract(Silent(cache, "attacker"), Silent(cache, "victim"), cfg)
    assert r.verdict == "no leak" and r.recovered == ""  # the attacker's own guesses never count


# ------------------------------------------------------------------ membership
@pytest.mark.parametrize(("shared", "verdict"), [(True, "leak"), (False, "no leak")])
def test_membership_tells_the_victims_prompt_on_a_shared_cache_only(shared: bool, verdict: str) -> None:
    r = run(TokenCache(None, report="block", shared=shared), strategy="membership")
    assert r.strategy == "membership" and r.verdict == verdict and r.candidates == 8
    victims = [c for c in r.membership if c.truth]
    assert len(victims) == 3 and len(r.membership) == 24
    assert all(c.signal == ("hit" if shared else "none") for c in victims)
    assert all(c.signal == "none" for c in r.membership if not c.truth)


def test_membership_of_a_candidates_file_is_one_round_at_chance_1_in_n() -> None:
    prompts = tuple(f"System: you are the assistant of customer {i:03d}; be brief and polite always." for i in range(5))
    r = run(TokenCache(None, report="exact"), candidates=prompts, strategy="auto")
    assert r.strategy == "membership" and r.candidates == 5
    assert [c.signal for c in r.membership if c.truth] == ["hit"]
    assert r.verdict == "inconclusive" and r.chance == pytest.approx(0.2)  # 1 in 5 is within chance


def test_the_dictionary_layout_ends_on_a_block_where_dots_merge_into_few_tokens() -> None:
    """Regression (vLLM's 32-token blocks, SmolLM2): its vocabulary merges runs of dots, so padding with dots
    alone never reached a block boundary and the dictionary attack sent no guess. A spaced unit counts one each."""
    import re

    from kvlab.probe.attacks.dictionary import aligned_prefix

    def count(text: str) -> int:  # a word or a run of up to 16 dots is one token; other characters one each
        return len(re.findall(r"\.{1,16}| ?\w+|.", text))

    base = "[id] Internal note for the assistant. The access code is: "
    for g in (16, 32, 128):
        prefix = aligned_prefix(base, "115", g, count)
        assert count(prefix + "115") % g == 0 and count(prefix) >= g, g


def test_the_time_budget_stops_the_attack_and_says_which_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """``max_seconds`` bounds the attack beside the request budget: on a clock that moves a second each time it
    is read, the token strategy stops mid-secret and says the time budget (not the requests) ran out."""
    import kvlab.probe.attacks.traffic as traffic

    ticks = itertools.count()
    monkeypatch.setattr(traffic.time, "monotonic", lambda: float(next(ticks)))
    r = run(TokenCache(ToyBpe()), max_seconds=5)
    assert r.strategy == "token" and len(r.recovered) < len(r.secret)
    last = r.steps[-1]
    assert last.outcome == "unreachable" and "the time budget (--max-seconds 5) was spent" in last.detail
    whole = run(TokenCache(ToyBpe()))  # the same attack without it: the whole secret
    assert whole.recovered == whole.secret
