"""The attention heatmaps: a colour bar in probabilities and the decoded tokens on both axes."""

from __future__ import annotations

import unicodedata

import torch
from matplotlib.figure import Figure

from kvlab.analysis.diversity import measure_diversity
from kvlab.analysis.plots import (
    MAX_TOKEN_LABELS,
    attention_matrix,
    decode_tokens,
    heads_figure,
    label_positions,
    token_label,
)
from kvlab.model import load_model


def _colorbars(fig: Figure) -> list:
    return [ax for ax in fig.axes if getattr(ax, "_colorbar", None) is not None]


def _texts(labels: list) -> list[str]:
    return [t.get_text() for t in labels]


def _formatted(axis: object) -> list[str]:
    """The labels an axis gives its ticks, shown or not (``get_ticklabels`` returns only the shown ones)."""
    return list(axis.get_major_formatter().format_ticks(axis.get_majorticklocs()))  # type: ignore[attr-defined]


def test_heatmaps_have_a_colour_bar_and_the_decoded_tokens_on_both_axes() -> None:
    lm = load_model("mini-gqa")
    prompt = "ab\tc d\n"
    res, cap, rid = measure_diversity(lm, lm.tokenizer.encode(prompt), max_tokens=4)
    matrix = attention_matrix(cap, rid, 3)
    t = matrix.shape[-1]
    assert t == len(prompt) + 4 - 1  # the last generated token is never read
    tokens = decode_tokens(lm.tokenizer, res.tokens[:t])
    fig = heads_figure(matrix, "t", tokens)
    bars = _colorbars(fig)
    assert len(bars) == 1
    assert bars[0].get_ylabel() == "attention probability"
    lo, hi = bars[0]._colorbar.mappable.get_clim()
    assert lo == 0.0 and abs(hi - float(matrix.max())) < 1e-6  # probabilities, not their square roots
    # The prompt's tokens, escaped where they would not show, then the generated ones, each decoded alone.
    expected = ["a", "b", "\\t", "c", "\u2423", "d", "\\n"]
    expected += [token_label(lm.tokenizer.decode([i])) for i in res.tokens[len(prompt) : t]]
    heads = [ax for ax in fig.axes if ax not in bars]
    assert len(heads) == 4
    for i, ax in enumerate(heads):
        assert list(ax.get_xticks()) == list(range(t)) and list(ax.get_yticks()) == list(range(t))
        assert _texts(ax.get_xticklabels()) == expected  # 4 heads in one row: every panel shows its keys
        assert _formatted(ax.yaxis) == expected
        assert _texts(ax.get_yticklabels()) == (expected if i == 0 else [])  # queries on the first panel


def test_long_sequences_are_thinned_and_only_outer_panels_carry_labels() -> None:
    t = 100
    matrix = torch.softmax(torch.randn(9, t, t), -1)
    tokens = [f"tok{i}" for i in range(t)]
    fig = heads_figure(matrix, "", tokens)
    heads = [ax for ax in fig.axes if getattr(ax, "_colorbar", None) is None and ax.get_visible() and ax.axison]
    assert len(heads) == 9
    ticks = label_positions(t)
    assert len(ticks) <= MAX_TOKEN_LABELS and ticks == list(range(0, t, 4))
    for i, ax in enumerate(heads):
        assert list(ax.get_xticks()) == ticks and list(ax.get_yticks()) == ticks
        assert _formatted(ax.xaxis) == _formatted(ax.yaxis) == [tokens[p] for p in ticks]
        # 9 heads in 4 columns: x labels where no panel is below (heads 5-8), y labels on heads 0, 4, 8.
        assert _texts(ax.get_xticklabels()) == ([tokens[p] for p in ticks] if i >= 5 else []), i
        assert _texts(ax.get_yticklabels()) == ([tokens[p] for p in ticks] if i % 4 == 0 else []), i
    assert len(_colorbars(fig)) == 1
    assert label_positions(32) == list(range(32)) and len(label_positions(33)) == 17


def test_heatmaps_without_tokens_keep_positions_and_get_a_colour_bar() -> None:
    fig = heads_figure(torch.softmax(torch.randn(2, 5, 5), -1), "t")
    assert len(_colorbars(fig)) == 1
    assert fig.axes[0].get_xlabel() == "key position"


def test_token_labels_escape_what_would_not_show() -> None:
    assert token_label("\n") == "\\n" and token_label("a\r\nb") == "a\\r\\nb"
    assert token_label("\x00\x1b[0m") == "\\x00\\x1b[0m"
    assert token_label("\u2028") == "\\u2028" and token_label("\u200b") == "\\u200b"  # line separator, ZWSP
    assert token_label("  ") == "\u2423\u2423" and token_label("") == "\u2205"
    assert token_label(" the") == " the"
    assert token_label("\ufffd") == "\ufffd"  # a lone byte of a multi-byte character, as the tokenizer says
    assert len(token_label("x" * 100)) <= 12
    for raw in ["\n", "a\tb", "\x7f", "  ", "", "请", "x" * 40, "\u0301", "<|im_end|>"]:
        label = token_label(raw)
        assert token_label(label) == label, raw  # idempotent
        assert not any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in label), (raw, label)
        assert label.strip(), raw
