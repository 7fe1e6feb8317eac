"""The Prometheus exporter's cost per request against the request's own service time, and scrape-to-panel latency:
how long after a request is observed its first-audio sample is visible through a real Prometheus server's API.

    python benchmarks/bench_prometheus.py [--repeats 3] [--limit 4] [--events 40] [--intervals 0.25,1] [--only tiers]

Cost: the ``mixed`` model workload (every modality) is replayed cache off then on, ``--repeats`` times; each
request's ``Exporter.observe`` call is timed inline and set against that request's measured service time (the
baseline, measured in the same run). Also the cost of rendering one scrape of the final state (``generate_latest``).
Latency: Debian's ``prometheus`` (on PATH) scrapes a fresh exporter every ``interval``; the cache-on run's audio
requests are observed again one by one at random gaps (uniform in [0, interval]) while a poller asks Prometheus
every 10 ms for ``sum(mmcache_time_to_first_audio_seconds_count)``; latency = first answer showing request k - the
moment request k was observed. Expected: up to one scrape interval plus the ingest and query time.
Tiers (``--only tiers`` runs them alone): the store tier's wait measurement (a ``WaitHistogram.observe`` and one more
clock read) against a whole lookup of a 16-page chain on an in-process store, the cheapest a lookup gets; one
``TierStack.stats()`` and one ``Exporter.sample`` of a cache with tiers; and a sizing replay with tiers (the embedded
Mooncake slice, 64k pool, 1M host tier, 4M store) with the exporter sampling it against the same replay without.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from prometheus_client import generate_latest  # noqa: E402
from timing import best  # noqa: E402  (benchmarks/timing.py, beside this script)

from workloads import registry  # noqa: E402
from workloads.harness.progress import quiet_third_party  # noqa: E402
from workloads.harness.prometheus import Exporter  # noqa: E402
from workloads.harness.promserver import PrometheusServer  # noqa: E402
from workloads.harness.serving import Schedule, compare  # noqa: E402
from workloads.options import ModelWorkloadOptions  # noqa: E402
from workloads.registry import embedded_slice  # noqa: E402
from workloads.sizing.replay import replay_trace  # noqa: E402
from workloads.sizing.tiers import TierModel  # noqa: E402
from workloads.traces.mooncake import load_mooncake  # noqa: E402


class TimedExporter(Exporter):
    """An exporter that records how long each ``observe`` took, with the request it observed."""

    def __init__(self):
        super().__init__()
        self.samples: list[tuple[float, float]] = []  # (observe seconds, request service seconds)
        self.observed: list[tuple] = []  # (run, record, cache_stats) of every call, for replaying into another

    def observe(self, run, record, cache_stats):
        t = time.perf_counter()
        super().observe(run, record, cache_stats)
        self.samples.append((time.perf_counter() - t, record.service_s))
        self.observed.append((run, record, cache_stats))


def cost(factory, repeats: int) -> TimedExporter:
    print(f"exporter cost per request, mixed workload, {repeats} replays (cache off + on each)")
    print(f"{'replay':>6} {'requests':>9} {'observe p50 (us)':>17} {'observe p99 (us)':>17} "
          f"{'service p50 (ms)':>17} {'sum observe / sum service':>26} {'worst request':>14}")
    ratios = []
    for k in range(repeats):
        exporter = TimedExporter()
        compare(factory, Schedule(), observer=exporter)
        obs, svc = map(np.array, zip(*exporter.samples))
        ratios.append(obs.sum() / svc.sum())
        print(f"{k + 1:>6} {obs.size:>9} {1e6 * np.median(obs):>17.1f} {1e6 * np.percentile(obs, 99):>17.1f} "
              f"{1e3 * np.median(svc):>17.1f} {100 * ratios[-1]:>25.3f}% {100 * (obs / svc).max():>13.3f}%")
    render = best(lambda: generate_latest(exporter.registry), repeats=5, inner=20)
    size = len(generate_latest(exporter.registry))
    print(f"exporter / service time over replays: min {100 * min(ratios):.3f}%, median "
          f"{100 * float(np.median(ratios)):.3f}%, max {100 * max(ratios):.3f}% (target < 1%)")
    print(f"one scrape of the final state: {1e3 * render:.2f} ms to render {size:,} bytes "
          f"(a scrape thread's share of one core at a 1 s interval: {100 * render:.2f}%)")
    return exporter


def latency(observed, interval_s: float, events: int, seed: int = 0) -> np.ndarray:
    """Seconds from observing each audio request to Prometheus answering with it, at scrape ``interval_s``."""
    audio = [o for o in observed if o[0].cached and o[1].ok and o[1].audio_s]
    rng = random.Random(seed)
    exporter = Exporter()
    port = exporter.serve(0)
    seen: list[tuple[float, float]] = []  # (time, count) answers of the poller
    done = threading.Event()
    try:
        with PrometheusServer([f"127.0.0.1:{port}"], interval_s) as prom:
            while not any(t["health"] == "up" for t in prom.targets_up()):
                time.sleep(0.05)

            def poll():
                while not done.is_set():
                    answer = prom.query("sum(mmcache_time_to_first_audio_seconds_count)")
                    seen.append((time.time(), float(answer[0]["value"][1]) if answer else 0.0))
                    time.sleep(0.01)

            poller = threading.Thread(target=poll)
            poller.start()
            observed_at = []
            for k in range(events):
                time.sleep(rng.uniform(0, interval_s))
                run, record, stats = audio[k % len(audio)]
                exporter.observe(run, record, stats)
                observed_at.append(time.time())
            time.sleep(2 * interval_s + 0.5)
            done.set()
            poller.join()
    finally:
        exporter.close()
    return np.array([next(t for t, n in seen if n >= k + 1) - at for k, at in enumerate(observed_at)])


def spread(values, scale: float = 1.0, fmt: str = ".2f") -> str:
    v = sorted(x * scale for x in values)
    return f"{statistics.median(v):{fmt}} [{v[0]:{fmt}}-{v[-1]:{fmt}}]"


def difference(on: list[float], off: list[float]) -> str:
    """The best of ``on`` against the best of ``off`` in percent, with its verdict: noise only when the difference
    is within the run-to-run spread (the wider max - min of the two series, in percent of the best of ``off``)."""
    best_on, best_off = min(on), min(off)
    diff, run_to_run = best_on - best_off, max(max(on) - best_on, max(off) - best_off)
    within = abs(diff) <= run_to_run
    return (f"{100 * diff / best_off:+.1f}%, {'within' if within else 'beyond'} the run-to-run spread of "
            f"{100 * run_to_run / best_off:.1f}%{': noise' if within else ''}")


def tier_cost(repeats: int) -> None:
    """The tier series' costs: the wait measurement on the lookup path, a sample, a sizing replay sampled."""
    import torch

    from mmcache import Fingerprint, HostPagePool, PagePool, PrefixCache
    from mmcache.histogram import WaitHistogram
    from mmcache.tiers import HostTier, MemoryStore, StoreTier, TierStack
    from mmcache.tiers.lineage import RequestLineage, root_lineage
    from mmcache.tiers.page_format import Expected
    from mmcache.tiers.store import WAIT_BOUNDS

    print(f"\ntier series: median [min-max] over {repeats} repeats of best-of timings")
    P, pages = 16, 16
    fp = Fingerprint(model="bench-tiers", page_size=P)
    pool = PagePool(pages, (P, 64), torch.float32)  # 4 KiB pages
    store = StoreTier(MemoryStore(4 * pages), publish_async=False, deadline_s=None)
    stack = TierStack(fp, host=HostTier(HostPagePool.like(pool, pages), P), store=store)
    ids = np.random.default_rng(0).integers(0, 30000, pages * P + 1).astype(np.int32)
    mids = np.zeros((pages, 2), dtype=np.uint64)
    names = [int(x) for x in np.random.default_rng(1).integers(1, 1 << 62, pages)]
    rows = list(range(pages))
    stack.publish(pool, rows, rows, names, ids, mids, b"")
    want = Expected(fp, b"", pool.page_shape, pool.dtype, pool.page_bytes)
    lineage = RequestLineage(root_lineage(fp, b""), ids, mids, P)
    lookup = [best(lambda: store.match(names, 0, ids, mids, lineage, want), 5, 200) for _ in range(repeats)]
    assert store.counters["hit_pages"] >= pages
    h = WaitHistogram(WAIT_BOUNDS)
    measure = [best(lambda: h.observe(time.monotonic() - 0.003), 5, 20000) for _ in range(repeats)]
    print(f"wait measurement {spread(measure, 1e9, '.0f')} ns per lookup; a 16-page lookup on an in-process store "
          f"{spread(lookup, 1e6)} us: {spread([m / x for m, x in zip(measure, lookup)], 100, '.3f')}% of it")
    exporter = Exporter()
    cache = PrefixCache(pool, fp, tiers=stack)
    stats = lambda: {"prefix": cache.stats().to_dict(), "tiers": stack.stats().to_dict()}  # noqa: E731
    snap = [best(stack.stats, 5, 2000) for _ in range(repeats)]
    sample = [best(lambda: exporter.sample(stats()), 5, 1000) for _ in range(repeats)]
    print(f"TierStack.stats() {spread(snap, 1e6)} us; one sample (prefix and tier stats, Exporter.sample) "
          f"{spread(sample, 1e6)} us")
    trace = load_mooncake(embedded_slice())
    tiers = TierModel(host_tokens=1 << 20, store_tokens=4 << 20)

    class Counting(Exporter):
        samples = 0

        def sample(self, cache_stats):
            self.samples += 1
            super().sample(cache_stats)

    def replay(observer):
        t = time.perf_counter()
        run = replay_trace(trace, page_size=512, pool_tokens=64 << 10, tiers=tiers, observer=observer)
        return time.perf_counter() - t, run

    times, counted = {"off": [], "on": []}, Counting()
    for _ in range(max(5, repeats)):  # interleaved; the best of each: the machine's load moves both
        for label, observer in (("off", None), ("on", counted)):
            took, run = replay(observer)
            times[label].append(took)
    on, off = min(times["on"]), min(times["off"])
    share = lambda t: 100 * t / run.prompt_tokens  # noqa: E731
    per_replay = counted.samples / len(times["on"])
    print(f"sizing replay with tiers ({trace.num_requests:,} requests; host {share(run.host_hit_tokens):.1f}%, store "
          f"{share(run.store_hit_tokens):.1f}% of prompt tokens), best of {len(times['on'])}: sampled {on:.3f} s, "
          f"unsampled {off:.3f} s ({difference(times['on'], times['off'])}; all runs sampled "
          f"{spread(times['on'])} s, unsampled {spread(times['off'])} s); {per_replay:.0f} samples a replay x one "
          f"sample = {100 * per_replay * statistics.median(sample) / off:.2f}% of it")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", type=int, default=4, help="requests per mixed component")
    ap.add_argument("--events", type=int, default=40, help="audio requests observed per scrape interval")
    ap.add_argument("--intervals", default="0.25,1", help="scrape intervals (s), comma-separated")
    ap.add_argument("--only", choices=("tiers",), help="run the tier series' section alone")
    args = ap.parse_args()
    quiet_third_party()
    if args.only == "tiers":
        return tier_cost(args.repeats)
    factory = registry.model_factory("mixed", ModelWorkloadOptions(limit=args.limit))
    exporter = cost(factory, args.repeats)
    print(f"\nscrape-to-panel latency of a first-audio sample, {args.events} requests per interval "
          "(real prometheus on 127.0.0.1, 10 ms poll)")
    print(f"{'scrape interval (s)':>20} {'p50 (s)':>8} {'p90 (s)':>8} {'max (s)':>8} {'max / interval':>15}")
    for interval in map(float, args.intervals.split(",")):
        lat = latency(exporter.observed, interval, args.events)
        print(f"{interval:>20g} {np.median(lat):>8.3f} {np.percentile(lat, 90):>8.3f} {lat.max():>8.3f} "
              f"{lat.max() / interval:>15.2f}")
    tier_cost(args.repeats)


if __name__ == "__main__":
    main()
