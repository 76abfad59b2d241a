"""The HTML report, opened in headless Chromium: every figure decodes and the page is not blank."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from kvlab.analysis.report_html import Anchors, slugify
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
    links = _check_contents(page)
    assert "strategy-b-no-cow-b-q-r" in links  # the name's letters and digits, nothing of its markup


class _Ids(HTMLParser):
    """Every element id of a page, and the links (with their text) inside the table of contents."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.links: list[str] = []
        self.link_text: list[str] = []
        self._in_contents = 0
        self._in_link = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id") is not None:
            self.ids.append(str(a["id"]))
        if tag == "nav" and a.get("id") == "contents":
            self._in_contents = 1
        elif self._in_contents and tag == "a":
            self.links.append(str(a.get("href")))
            self.link_text.append("")
            self._in_link = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "nav":
            self._in_contents = 0
        elif tag == "a":
            self._in_link = False

    def handle_data(self, data: str) -> None:
        if self._in_link:
            self.link_text[-1] += data


def _check_contents(page: str) -> list[str]:
    """The table of contents comes first and each of its links names an element of the page; returns the
    linked ids."""
    p = _Ids()
    p.feed(page)
    assert len(p.ids) == len(set(p.ids)), "duplicate ids"
    assert p.ids[0] == "contents" and page.index('<nav id="contents">') < page.index("<table")
    assert p.links and all(h.startswith("#") for h in p.links), p.links
    targets = [h[1:] for h in p.links]
    assert set(targets) <= set(p.ids), set(targets) - set(p.ids)
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", t) for t in targets), targets  # safe in a URL as is
    # Every section and every trial shown has an entry: each h2 but the contents' own, each trial's div.
    sections = re.findall(r'<h2 id="([^"]+)">', page) + re.findall(r'<div class="trial [a-z]+" id="([^"]+)">', page)
    assert sorted(sections) == sorted(targets)
    return targets


def test_contents_link_every_section_and_trial(report: Path) -> None:
    page = report.read_text(encoding="utf-8")
    links = _check_contents(page)
    assert links[:4] == [
        "summary-what-the-answers-show",
        "summary-what-the-cache-did",
        "summary-against-the-founding-document-s-table",
        "head-diversity",
    ]
    assert "strategy-shared-no-cow" in links and "strategy-shared-cow" in links
    assert "strategy-shared-no-cow-contaminated-trial-0" in links
    assert sum("-trial-" in t for t in links) == page.count('<div class="trial ')


def test_anchors_are_safe_stable_and_unique() -> None:
    assert slugify("shared-no-cow") == "shared-no-cow"
    assert slugify('<b>no-cow</b> & "q"') == "b-no-cow-b-q"
    assert slugify("Café  crème!") == "cafe-creme"
    zh = slugify("共享缓存")
    assert re.fullmatch(r"x[0-9a-f]{8}", zh) and zh == slugify("共享缓存") != slugify("共享")  # stable, distinct
    assert re.fullmatch(r"x[0-9a-f]{8}", slugify(""))
    anchors = Anchors(reserved=["contents"])
    made = [anchors("strategy", n) for n in ["a b", "a-b", "A_B", "a-b-2"]] + [anchors("contents")]
    assert made == ["strategy-a-b", "strategy-a-b-2", "strategy-a-b-3", "strategy-a-b-2-2", "contents-2"]


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


def test_the_report_sets_the_run_beside_the_founding_documents_table(report: Path) -> None:
    page = report.read_text(encoding="utf-8")
    assert "Against the founding document&#39;s table" in page or "Against the founding document's table" in page
    # The document's own words for its groups 2 and 3, and this run's outcomes beside them.
    assert "about 30%: both outputs the same, both request A&#39;s answer" in page
    assert re.search(r"shared-no-cow</td><td>[^<]+</td><td>foreign read \d+%, output changed \d+%", page)
    assert re.search(r"shared-cow</td><td>[^<]+</td><td>foreign read 0%, output changed 0%", page)
    assert "1: no sharing" not in page  # isolated did not run here: its row is left out, not filled with zeros
