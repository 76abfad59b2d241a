"""kvlab.testing as a user would call it from their own suite (the seed's passphrase regression test)."""

from __future__ import annotations

import pytest

from kvlab.testing import assert_isolation

PAIR = [["请把以下内容翻译成英文：今天天气很好", "请把以下内容翻译成英文：今天天气很差"]]


def test_default_cache_keeps_isolation_over_the_seed_pair() -> None:
    summary = assert_isolation("mini", "shared-cow", passphrases=PAIR, trials=10)
    assert summary.peak_shared_refcount >= 2  # the prefix really was shared
    assert summary.cow_copies >= summary.trials


def test_custom_knobs_are_checked_too() -> None:
    summary = assert_isolation(
        "mini", "shared-cow", cache={"block_size": 4, "prefix_granularity": "block"}, passphrases=PAIR, trials=6
    )
    assert summary.strategy == "shared-cow+custom"
    assert summary.peak_shared_refcount >= 2


def test_a_leaking_configuration_fails_with_the_root_cause() -> None:
    with pytest.raises(AssertionError) as exc:
        assert_isolation(
            "mini", "shared-cow", cache={"copy_on_write": False, "unsafe": True}, passphrases=PAIR, trials=4
        )
    text = str(exc.value)
    assert "trials broke isolation" in text
    assert "written by request" in text and "read block" in text
