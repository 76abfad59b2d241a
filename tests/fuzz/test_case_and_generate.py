"""Cases: validation and JSON round trip. Generation: seeded per trial, collision-prone, and exactly what
hypothesis replays from the recorded choices (the foundation of shrinking)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis.database import InMemoryExampleDatabase, choices_to_bytes

from kvlab.config import ConfigError
from kvlab.fuzz import (
    CaseMeta,
    FuzzCase,
    FuzzConfig,
    FuzzRequest,
    FuzzSettings,
    WorkloadBounds,
    build_case,
    draw_case,
)
from kvlab.fuzz.generate import ReplayChooser
from kvlab.fuzz.shrink import _cases

CASE = FuzzCase(
    FuzzConfig(block_size=4, num_blocks=9, max_num_seqs=2, max_num_batched_tokens=5, layout="HND"),
    (
        FuzzRequest((97, 98, 99, 97, 98), arrival=0, max_tokens=3, n=2, salt="tenant-1"),
        FuzzRequest((97, 98, 99, 97), arrival=2, max_tokens=2, abort_at=4),
    ),
    strategy="weak-hash",
    note={"trial": 7},
)


def test_case_json_round_trip_and_digest(tmp_path):
    path = CASE.save(tmp_path / "case.json")
    text = path.read_text()
    assert json.loads(text)["requests"][1]["abort_at"] == 4
    assert len(text.splitlines()) < 30  # one request per line: a minimal case reads at a glance
    back = FuzzCase.load(path)
    assert back == CASE and back.note == {"trial": 7}
    assert back.digest() == CASE.digest()
    assert FuzzCase(CASE.config, CASE.requests[:1]).digest() != CASE.digest()
    assert CASE.size() == (2, 9, 8)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: FuzzConfig(block_size=0), "block_size"),
        (lambda: FuzzConfig(layout="XYZ"), "layout"),
        (lambda: FuzzConfig(hash_algo="md5"), "hash_algo"),
        (lambda: FuzzConfig(attention_backend="flash"), "attention_backend"),
        (lambda: FuzzConfig(kv_cache_dtype="fp16"), "kv_cache_dtype"),
        (lambda: FuzzRequest((1,), arrival=3, abort_at=2), "abort_at"),
        (lambda: FuzzRequest((1,), n=0), "n"),
        (lambda: FuzzCase(FuzzConfig(), ()), "requests"),
        (lambda: FuzzSettings(strategy="no-such-strategy"), "strategy"),
        (lambda: FuzzSettings(kv_cache_dtype="fp16"), "kv_cache_dtype"),
        (lambda: WorkloadBounds(block_sizes=()), "block_sizes"),
    ],
)
def test_configuration_is_validated_and_names_the_field(make, field):
    with pytest.raises(ConfigError, match=field):
        make()


def test_a_case_file_of_another_format_is_refused():
    d = CASE.to_dict()
    d["format"] = 99
    with pytest.raises(ConfigError, match="format"):
        FuzzCase.from_dict(d)


def test_each_trial_is_drawn_from_seed_and_index():
    meta = CaseMeta()
    a = draw_case(meta, 0, 5)
    assert draw_case(meta, 0, 5) == a
    assert draw_case(meta, 0, 6).case != a.case and draw_case(meta, 1, 5).case != a.case


def test_draws_collide_on_purpose():
    """Across trials: identical prompts, prompts that are prefixes of others, cuts on a block boundary and
    one either side of it, forks, aborts, salts, tight pools and chunked prefill all occur."""
    seen = set()
    for i in range(150):
        case = draw_case(CaseMeta(), 0, i).case
        bs = case.config.block_size
        prompts = [r.prompt for r in case.requests]
        for p in prompts:
            for q in prompts:
                if p is q:
                    continue
                common = next((k for k, (x, y) in enumerate(zip(p, q, strict=False)) if x != y), min(len(p), len(q)))
                if p == q:
                    seen.add("identical")
                elif common == len(p):
                    seen.add("prefix")
                if common >= bs:
                    seen.add({0: "on boundary", 1: "boundary+1", bs - 1: "boundary-1"}.get(common % bs, "shared"))
        seen |= {"fork" for r in case.requests if r.n > 1} | {"abort" for r in case.requests if r.abort_at is not None}
        seen |= {"salt" for r in case.requests if r.salt}
        if case.config.max_num_batched_tokens < max(len(p) for p in prompts):
            seen.add("chunked")
    assert seen >= {
        "identical",
        "prefix",
        "on boundary",
        "boundary-1",
        "boundary+1",
        "fork",
        "abort",
        "salt",
        "chunked",
    }


def test_hypothesis_replays_a_recorded_trial_exactly():
    """Shrinking starts from the trial's own choices: replayed through hypothesis they must build the very
    same case, or the shrinker would be shrinking another workload."""
    meta = CaseMeta(strategy="empty-request", bounds=WorkloadBounds(allow_empty=True))
    for index in range(5):
        drawn = draw_case(meta, 3, index)
        db = InMemoryExampleDatabase()
        db.save(b"k.secondary", choices_to_bytes(drawn.choices))
        conf = settings(database=db, phases=[Phase.reuse], suppress_health_check=list(HealthCheck), deadline=None)
        first = find(_cases(meta), lambda c: True, settings=conf, database_key=b"k")
        assert first == drawn.case
        # The first shrinking pass edits the same record: dropping a request leaves the others as drawn.
        if len(drawn.case.requests) > 1:
            at = drawn.keep_at[0]
            dropped = build_case(ReplayChooser([*drawn.choices[:at], False, *drawn.choices[at + 1 :]]), meta)
            assert dropped.requests == drawn.case.requests[1:]


def test_trials_draw_both_attention_backends_and_old_cases_replay_on_the_reference():
    """Half the trials run the compiled kernels (paged attention in place, fused ops), so every fuzz property
    covers them too; a case saved before the knob existed replays on the reference path it ran on."""
    backends = [draw_case(CaseMeta(), 3, i).case.config.attention_backend for i in range(40)]
    assert 8 <= backends.count("cpp") <= 32 and set(backends) == {"reference", "cpp"}
    d = CASE.to_dict()
    del d["config"]["attention_backend"]
    assert FuzzCase.from_dict(d).config.attention_backend == "reference"


def test_trials_draw_rounding_caches_and_old_cases_replay_over_the_models_dtype():
    """Some trials store K/V in bf16 or fp8 (both formats), so every fuzz property covers the rounded writes
    and their copies (drawn last: test_public_prefixes); a case saved before the knob existed replays over the
    model's own dtype, and one that sets it keeps it."""
    drawn = [draw_case(CaseMeta(), 3, i).case for i in range(80)]
    dtypes = [c.config.kv_cache_dtype for c in drawn]
    assert set(dtypes) == {"auto", "bfloat16", "fp8", "fp8_e5m2"} and 40 <= dtypes.count("auto") <= 70
    d = CASE.to_dict()
    assert "kv_cache_dtype" not in d["config"]  # an fp32 case's file and digest are what they were
    assert FuzzCase.from_dict(d).config.kv_cache_dtype == "auto"
    fp8 = FuzzCase(FuzzConfig(kv_cache_dtype="fp8"), CASE.requests)
    assert (
        FuzzCase.from_dict(json.loads(fp8.to_json())) == fp8
        and fp8.digest() != FuzzCase(FuzzConfig(), CASE.requests).digest()
    )
