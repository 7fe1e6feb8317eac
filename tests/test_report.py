"""The cache-on vs cache-off report: files, JSON numbers, embedded PNGs, and a real headless-browser render."""

import base64
import io
import json
import re
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from workloads.harness.metrics import SLO, summarize, summary_rows
from workloads.harness.report import savings, write_report
from workloads.harness.serving import Schedule, compare

CHROMIUM = Path("/usr/bin/chromium")
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


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no headless browser: apt-get install chromium")
def test_report_renders_in_headless_chromium(report, tmp_path):
    *_, html_path, _ = report
    shot = tmp_path / "report.png"
    subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,2400", f"--screenshot={shot}",
                    html_path.resolve().as_uri()], check=True, capture_output=True, timeout=60)
    img = _assert_nonuniform_png(shot.read_bytes(), min_size=(1280, 2400))
    assert len(img.resize((64, 120)).getcolors(maxcolors=1 << 16)) > 20  # text, tables, plots: not an error page
