"""The HTML report, opened in headless Chromium: every figure decodes and the page is not blank."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from kvlab.cli import app

CHROMIUM = shutil.which("chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--virtual-time-budget=5000",  # let the load event (and the figure check it runs) fire before dumping
]


def _chromium(tmp_path: Path, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"profile-{name}"  # a fresh profile per run: no state leaks between runs
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("report")
    res = CliRunner().invoke(
        app, ["experiment", "--strategies", "shared-no-cow,shared-cow", "--trials", "2", "--report", str(d)]
    )
    assert res.exit_code == 0, res.output
    return d / "report.html"


def test_report_is_self_contained_and_shows_a_contaminated_trial(report: Path) -> None:
    page = report.read_text(encoding="utf-8")
    srcs = re.findall(r'<img class="fig" alt="[^"]*" src="([^"]*)"', page)
    assert len(srcs) >= 5  # diversity, and a timeline + heatmaps for each shown trial
    assert all(s.startswith("data:image/png;base64,") for s in srcs)
    assert not re.search(r'(src|href)="(https?:|//|file:)', page)
    assert "contaminated trial" in page and "Root cause (sanitizer)" in page
    assert "written while the reader held the block" in page  # the no-CoW overwrite, replayed from the trace


# Prompts, group and strategy names are the user's text (a passphrase file): they must reach the page as text.
PROMPT = """<script>alert(1)</script> Tom & Jerry say "hi" and 'bye', passphrase:"""
PROMPT_HTML = "&lt;script&gt;alert(1)&lt;/script&gt; Tom &amp; Jerry say &#34;hi&#34; and &#39;bye&#39;, passphrase:"
GROUP = """g<i>&"'"""
STRATEGY = """<b>no-cow</b> & "q" 'r'"""


def test_user_text_is_escaped(tmp_path: Path) -> None:
    spec = tmp_path / "p.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "groups": [{"name": GROUP, "prompts": [f"{PROMPT} orange-kite-42", f"{PROMPT} purple-lamp-17"]}],
                "strategies": [
                    {
                        "name": STRATEGY,
                        "description": "<em>desc</em>",
                        "expect": "unsafe",
                        "cache": {"copy_on_write": False, "reference_counting": False, "unsafe": True},
                    }
                ],
            }
        ),
        encoding="utf-8",
    )
    res = CliRunner().invoke(
        app,
        ["experiment", "--passphrases", str(spec), "--strategies", STRATEGY, "--trials", "2"]
        + ["--report", str(tmp_path)],
    )
    assert res.exit_code == 0, res.output
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert page.count("<script") == 1  # the page's own figure check, nothing from the prompts
    for raw in ("<script>alert", "Tom & Jerry", 'say "hi"', "'bye'", "<i>", "<b>", "<em>"):
        assert raw not in page, raw
    assert page.count(PROMPT_HTML) >= 3  # the diversity prompt and each request of the shown trials
    assert "g&lt;i&gt;&amp;&#34;&#39;" in page
    assert "&lt;b&gt;no-cow&lt;/b&gt; &amp; &#34;q&#34; &#39;r&#39;" in page
    assert "&lt;em&gt;desc&lt;/em&gt;" in page


def test_figures_need_no_pyplot() -> None:
    # pyplot selects a backend when imported; the figures are bare Figures and must work without it.
    code = (
        "import sys, torch\n"
        "from matplotlib.figure import Figure\n"
        "import kvlab.analysis.report_html\n"
        "from kvlab.analysis.plots import heads_figure\n"
        "fig = heads_figure(torch.rand(2, 3, 3), 't')\n"
        "assert isinstance(fig, Figure)\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("KVLAB_REQUIRE_CHROMIUM"),
    reason="chromium not installed (Debian package chromium; .ci/run installs it)",
)
def test_report_renders_in_headless_chromium(report: Path, tmp_path: Path) -> None:
    assert CHROMIUM is not None, "KVLAB_REQUIRE_CHROMIUM is set but chromium is not installed"
    n_figs = report.read_text(encoding="utf-8").count('<img class="fig"')
    dom = _chromium(tmp_path, "dom", "--dump-dom", report.as_uri()).stdout
    m = re.search(r'data-figures="(\d+)/(\d+)"', dom)
    assert m, "the page's load check did not run"
    assert (int(m[1]), int(m[2])) == (n_figs, n_figs), f"only {m[1]} of {n_figs} figures decoded"

    shot = tmp_path / "shot.png"
    _chromium(tmp_path, "shot", "--window-size=1280,2400", f"--screenshot={shot}", report.as_uri())
    img = matplotlib.image.imread(shot)[..., :3]
    assert img.shape[:2] == (2400, 1280)
    not_white = (img < 0.95).any(-1).mean()
    colours = len(np.unique((img * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    # Measured on a good page: ~30% of pixels not white and thousands of colours (figures); a blank
    # or text-only page has ~0% / a handful.
    assert not_white > 0.10 and colours > 500, (not_white, colours)
