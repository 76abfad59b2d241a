from __future__ import annotations

from pathlib import Path

import pytest

from kvlab.experiment.passphrases import (
    PassphraseFileError,
    default_passphrases,
    load_passphrases,
    parse_passphrases,
)
from kvlab.tokenizer import ByteTokenizer


def test_default_set_has_the_seed_pair_and_the_required_groups() -> None:
    s = default_passphrases()
    assert s.group("seed-weather").prompts == (
        "请把以下内容翻译成英文：今天天气很好",
        "请把以下内容翻译成英文：今天天气很差",
    )
    assert s.group("near-miss").kind == "near-miss"
    assert any(p.isascii() for p in s.group("english").prompts)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_long_group_shares_about_50_tokens_and_differs_in_about_10() -> None:
    tok = ByteTokenizer()
    a, b = (tok.encode(p) for p in default_passphrases().group("long-zh").prompts[:2])
    shared = _common_prefix(a, b)
    assert 45 <= shared <= 75 and 5 <= len(a) - shared <= 15


def test_near_miss_prompts_are_two_swapped_tokens_in_the_first_block() -> None:
    tok = ByteTokenizer()
    a, b = (tok.encode(p) for p in default_passphrases().group("near-miss").prompts)
    diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    assert len(diff) == 2 and max(diff) < 16
    assert sorted(a[:16]) == sorted(b[:16])  # same multiset: an order-blind hash collides


def test_custom_set_with_chat_template_and_strategy(tmp_path: Path) -> None:
    p = tmp_path / "set.json"
    p.write_text(
        '{"chat_template": true, "groups": [{"name": "g", "prompts": ["x1", "x2"]}],'
        ' "strategies": [{"name": "mine", "cache": {"block_size": 8}, "expect": "safe"}]}',
        encoding="utf-8",
    )
    s = load_passphrases(p)
    assert s.groups[0].chat_template is True
    assert s.strategies[0].cache == {"block_size": 8}


@pytest.mark.parametrize(
    ("text", "fmt", "needle"),
    [
        ("groups:\n  - name: a\n    prompts: [x, y\n", "yaml", "f.yaml: line 4"),
        ('{"groups": [\n {"name": "a", "prompts": ["x",]}]}', "json", "f.yaml: line 2"),
        ("groups:\n  - name: a\n    prompts: []\n", "yaml", "groups[0] ('a').prompts is empty"),
        ("groups:\n  - name: a\n    prompts: [x]\n    colour: red\n", "yaml", "unknown key 'colour' in groups[0]"),
        ("grups: []\n", "yaml", "unknown key 'grups' in the top level"),
        ("groups:\n  - name: a\n    kind: odd\n    prompts: [x]\n", "yaml", "kind must be one of"),
        (
            "groups:\n  - {name: a, prompts: [x]}\nstrategies:\n  - {name: s, cache: {blocksize: 4}}\n",
            "yaml",
            "unknown cache knob 'blocksize'",
        ),
        ("groups:\n  - {name: a, prompts: [x]}\n  - {name: a, prompts: [y]}\n", "yaml", "'a' is used twice"),
        (
            "groups:\n  - {name: a, prompts: [x]}\nstrategies:\n  - just-a-name\n",
            "yaml",
            "strategies[0] must be a mapping",
        ),
        (
            "groups:\n  - {name: a, prompts: [x]}\nstrategies:\n  - {name: s, colour: red}\n",
            "yaml",
            "unknown key 'colour' in strategies[0]",
        ),
    ],
)
def test_bad_files_name_file_line_or_key(text: str, fmt: str, needle: str) -> None:
    with pytest.raises(PassphraseFileError) as exc:
        parse_passphrases(text, "f.yaml", fmt)
    assert needle in str(exc.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PassphraseFileError, match="no such file"):
        load_passphrases(tmp_path / "nope.yaml")
