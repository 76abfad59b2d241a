"""The HTML report, opened in headless Chromium: every figure decodes and the page is not blank."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import matplotlib.image
import numpy as np
import pytest
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


def _chromium(tmp_path, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"profile-{name}"  # a fresh profile per run: no state leaks between runs
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    res = CliRunner().invoke(
        app, ["experiment", "--strategies", "shared-no-cow,shared-cow", "--trials", "2", "--report", str(d)]
    )
    assert res.exit_code == 0, res.output
    return d / "report.html"


def test_report_is_self_contained_and_shows_a_contaminated_trial(report) -> None:
    page = report.read_text(encoding="utf-8")
    srcs = re.findall(r'<img class="fig" alt="[^"]*" src="([^"]*)"', page)
    assert len(srcs) >= 5  # diversity, and a timeline + heatmaps for each shown trial
    assert all(s.startswith("data:image/png;base64,") for s in srcs)
    assert not re.search(r'(src|href)="(https?:|//|file:)', page)
    assert "contaminated trial" in page and "Root cause (sanitizer)" in page
    assert "written while the reader held the block" in page  # the no-CoW overwrite, replayed from the trace


@pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("KVLAB_REQUIRE_CHROMIUM"),
    reason="chromium not installed (Debian package chromium; .ci/run installs it)",
)
def test_report_renders_in_headless_chromium(report, tmp_path) -> None:
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
