"""The cache-on vs cache-off report: files, JSON numbers, embedded PNGs, and a real headless-browser render."""

import base64
import html
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from workloads.harness.metrics import SLO, summarize, summary_rows
from workloads.harness.report import savings, write_report
from workloads.harness.serving import Schedule, compare

CHROMIUM = "chromium"  # Debian's package name and command
DATA_PNG = re.compile(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"')
SLO_ = SLO(ttft_s=0.05, ttfa_s=0.1)

@pytest.fixture(scope="module")
def report(tiny_chat, tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    off, on = compare(tiny_chat.factory(pool_pages=40, missing=frozenset({"s2t0"})),
                      Schedule())  # turns interleave across sessions: the small pool evicts live contexts
    html_path, json_path = write_report(off, on, root / "report.html", root / "report.json", SLO_)
    return off, on, html_path, json_path


def _assert_nonuniform_png(data: bytes, min_size=(200, 150)) -> Image.Image:
    Image.open(io.BytesIO(data)).verify()  # structure and CRCs
    img = Image.open(io.BytesIO(data)).convert("RGB")
    assert img.width >= min_size[0] and img.height >= min_size[1], img.size
    assert any(lo < hi for lo, hi in img.getextrema()), "a blank image"
    return img


def test_report_json_holds_the_same_numbers(report):
    off, on, html_path, json_path = report
    data = json.loads(json_path.read_text())
    assert data["workload"] == "tiny-chat" and data["slo"] == str(SLO_)
    for key, run in (("off", off), ("on", on)):
        assert data["summary"][key] == json.loads(json.dumps(summarize(run, SLO_)))
        assert [r["rid"] for r in data["requests"][key]] == [r.rid for r in run.records]
        assert len(data["occupancy"][key]) == len(run.records)
    assert data["table"] == [dict(zip(("metric", "off", "on", "on/off"), r)) for r in summary_rows(off, on, SLO_)]
    assert data["savings_s"] == pytest.approx(savings(off, on)) and set(data["savings_s"]) == {"image", "prefill",
                                                                                                  "speaker"}
    s = data["summary"]["on"]
    assert s["failed"] == 1 and "'s2t0'" in s["errors"][0]
    assert s["cache_stats"]["prefix"]["evicted_pages"] > 0  # a 40-page pool evicts, so realized < ceiling
    assert s["of_ceiling"]["prefix"] < 1 and data["hit_rate_series"]["on"]["prefix"][-1][1] == s["hit_rate"]["prefix"]


def test_html_is_self_contained_and_every_plot_is_a_real_png(report):
    *_, html_path, _ = report
    page = html_path.read_text()
    assert "<script" not in page and not re.search(r'(?:src|href)="(?!data:)', page)
    assert "prefix hit rate (tokens)" in page and "s2t0" in page
    pngs = DATA_PNG.findall(page)
    assert len(pngs) == 9  # hit rate, occupancy, savings + CDFs of TTFT, ITL, TTFA, E2E, queueing, service
    for b64 in pngs:
        _assert_nonuniform_png(base64.b64decode(b64, validate=True))


def _chromium(tmp_path, url: str, *flags: str) -> str:
    """Run headless Chromium on ``url`` with a fresh profile, nothing fetched from the network; its stdout."""
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           "--hide-scrollbars", f"--user-data-dir={profile}", *flags, url],
                          check=True, capture_output=True, text=True, timeout=120)
    return done.stdout


def _probe(html_path: Path, tmp_path: Path) -> dict:
    """What the browser made of every <img>: decoded size and laid-out box (CSS px), from a copy of the report with
    a probe script (the report itself has none) that writes them into the DOM at ``load``."""
    probe = tmp_path / "probe.html"
    probe.write_text(html_path.read_text().replace("</body>", PROBE + "</body>"))
    dom = _chromium(tmp_path, probe.as_uri(), "--window-size=1280,800", "--virtual-time-budget=5000", "--dump-dom")
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    return json.loads(html.unescape(found.group(1)))


PROBE = """<script>addEventListener("load", () => {
  const out = document.createElement("pre"); out.id = "probe";
  out.textContent = JSON.stringify({height: document.documentElement.scrollHeight,
    images: [...document.images].map(i => { const r = i.getBoundingClientRect(), s = getComputedStyle(i);
      return {complete: i.complete, natural: [i.naturalWidth, i.naturalHeight], box: [r.left, r.top, r.width, r.height],
              shown: s.display !== "none" && s.visibility === "visible" && s.opacity === "1"}; })});
  document.body.appendChild(out); });</script>"""


def _inked(img: Image.Image) -> float:
    """Share of pixels that are not near-white."""
    gray = np.asarray(img.convert("L"))
    return float((gray < 200).mean())


@pytest.mark.skipif(shutil.which(CHROMIUM) is None,
                    reason="no headless browser: apt-get install chromium (.ci/run does)")
@pytest.mark.slow
def test_report_renders_in_headless_chromium(report, tmp_path):
    *_, html_path, _ = report
    first = tmp_path / "first.png"  # the first screen a reader sees: title, summary table
    _chromium(tmp_path, html_path.resolve().as_uri(), "--window-size=1280,800", f"--screenshot={first}")
    img = _assert_nonuniform_png(first.read_bytes(), min_size=(1280, 800))
    assert 0.01 < _inked(img) < 0.6 and len(img.resize((64, 40)).getcolors(maxcolors=1 << 16)) > 20

    seen = _probe(html_path, tmp_path)
    embedded = DATA_PNG.findall(html_path.read_text())
    assert len(seen["images"]) == len(embedded) == 9
    for b64, shown in zip(embedded, seen["images"]):  # decoded by the browser at the size the PNG says
        assert shown["complete"] and shown["shown"], shown
        assert tuple(shown["natural"]) == Image.open(io.BytesIO(base64.b64decode(b64))).size
        assert shown["box"][2] > 200 and shown["box"][3] > 100, shown

    whole = tmp_path / "whole.png"  # the whole page in one screen: every plot's box has ink where the browser drew it
    _chromium(tmp_path, html_path.resolve().as_uri(), f"--window-size=1280,{seen['height']}", f"--screenshot={whole}")
    page = Image.open(whole).convert("RGB")
    for shown in seen["images"]:
        x, y, w, h = (round(v) for v in shown["box"])
        assert _inked(page.crop((x + 2, y + 2, x + w - 2, y + h - 2))) > 0.02, shown


def test_saving_labels_show_noise_as_no_change():
    from workloads.harness.report import saving_label
    assert saving_label(1.0, 0.4) == "saved 0.600 s (60%)"
    assert saving_label(0.100, 0.101) == "no change"  # decode's "saved -0.001 s" was timing noise
    assert saving_label(1.0, 1.5) == "took 0.500 s more"


def test_occupancy_axis_is_scaled_to_the_pages_used(monkeypatch):
    from workloads.harness import report
    from workloads.harness.metrics import RunResult
    limits = {}
    real = report._figure

    def spy(*a):
        fig, limits["ax"] = real(*a)
        return fig, limits["ax"]

    monkeypatch.setattr(report, "_figure", spy)
    on = RunResult("w", True, "trace", {}, occupancy=[(0.0, 0, 50, 4046), (1.0, 20, 150, 3936)])  # 10 both
    report._occupancy(on)
    assert limits["ax"].get_ylim()[1] == pytest.approx(1.15 * 160)
    assert "4,096 pages, at most 160 in use (3.9%)" in limits["ax"].get_title()
