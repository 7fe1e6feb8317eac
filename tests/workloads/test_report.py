"""The cache-on vs cache-off report: files, JSON numbers, embedded PNGs, and a real headless-browser render."""

import base64
import dataclasses
import html
import io
import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from mmcache import EncoderStore, HostPagePool, PagePool, PrefixCache
from mmcache.stats import COUNTERS, KINDS, TIERS, counter_values
from mmcache.tiers import EncoderHostTier, EncoderTiers, HostTier, MemoryStore, StoreTier, TierStack
from tiny_chat import P, TinyChat
from workloads.harness.metrics import SLO, summarize, summary_rows
from workloads.harness.prometheus import Exporter
from workloads.harness.report import counter_rows, savings, write_report
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


class TieredChat(TinyChat):
    """TinyChat with every tier: the prefix cache over a host tier of 16 pages, the encoder store (room for one output)
    over a host tier of 6 pages, both over one shared in-process store tier of 24 entries; ``cache_stats`` with the
    tiers' stats."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.shared = StoreTier(MemoryStore(24), publish_async=False, deadline_s=None)
        pool = PagePool(self.cache.pool.num_pages)
        self.stack = TierStack(self.cache.fingerprint, host=HostTier(HostPagePool.like(pool, 16), P), store=self.shared)
        self.cache = PrefixCache(pool, self.cache.fingerprint, evict_batch_pages=1, tiers=self.stack)
        host = EncoderHostTier(HostPagePool(6, (512,), torch.uint8))
        self.store = EncoderStore(capacity_bytes=3 * 512, page_bytes=512,
                                  tiers=EncoderTiers(host=host, store=self.shared))

    def cache_stats(self) -> dict:
        return {**super().cache_stats(), "tiers": self.stack.stats().to_dict()}


@pytest.fixture(scope="module")
def tiered(tiny_chat, tmp_path_factory):
    """(off, on, Prometheus samples, HTML, JSON) of one replay of ``TieredChat`` observed by an exporter, scraped
    over HTTP at the end, and its report."""
    root = tmp_path_factory.mktemp("tiered")
    exporter = Exporter(slo=SLO_)
    port = exporter.serve(0)
    try:
        kit = dataclasses.replace(tiny_chat, cls=TieredChat)
        off, on = compare(kit.factory(pool_pages=40), Schedule(), observer=exporter)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        exporter.close()
    html_path, json_path = write_report(off, on, root / "report.html", root / "report.json", SLO_)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    return off, on, samples, html_path.read_text(), json.loads(json_path.read_text())


def test_every_counter_is_the_same_in_stats_prometheus_and_the_html_report(tiered):
    """Each cell of the counter table (``mmcache.stats.COUNTERS``: counter, tier, kind) read off the replay's stats
    is the Prometheus series of its name and labels and the report's row of its name, with the same value."""
    off, on, samples, page, data = tiered
    stats = counter_values(on.cache_stats)
    assert counter_values(off.cache_stats) == dict.fromkeys(stats, 0)  # the cache-off run bypasses every cache
    assert {(t, k) for _, t, k in stats} == {(t, k) for t in TIERS for k in KINDS}  # every tier of both kinds
    assert {name for name, *_ in stats} == {c.name for c in COUNTERS}
    for key in ("evicted_pages", "device", "kv"), ("evicted_pages", "device", "encoder"), \
            ("hit_tokens", "host", "kv"), ("hits", "host", "encoder"), ("put_stored", "store", "encoder"):
        assert stats[key] > 0, key
    assert data["counters"] == counter_rows(off, on) == [
        {"name": n, "tier": t, "kind": k, "off": 0, "on": v} for (n, t, k), v in stats.items()]
    rows = {m[:3]: int(m[4].replace(",", "")) for m in re.findall(
        r"<tr><td>(\w+)</td><td>(\w+)</td><td>(\w+)</td><td>([\d,]+)</td><td>([\d,]+)</td></tr>", page)}
    assert rows == stats
    for (name, tier, kind), count in stats.items():
        assert samples[f"mmcache_tier_{name}_total", (("kind", kind), ("tier", tier))] == count, (name, tier, kind)
    for c in COUNTERS:  # what it counts, under its name, in the report and in the series' help
        assert f"<dt>{c.name}</dt><dd>{html.escape(c.meaning)}</dd>" in page
    assert data["summary"]["on"]["cache_stats"] == json.loads(json.dumps(on.cache_stats))


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
