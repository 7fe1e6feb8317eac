"""Digest throughput per algorithm, and digest cost against decode + preprocess for real-size images.

    python benchmarks/bench_digests.py [--repeats 5] [--data PATH]
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import best  # noqa: E402  (benchmarks/timing.py, beside this script)

import digests  # noqa: E402
from workloads.registry import data_place  # noqa: E402


def synthetic(fmt: str, side: int, noise: float) -> bytes:
    """A photo-like test image: smooth gradients plus Gaussian noise, sized by ``side`` and ``noise`` to ~1 MB."""
    y, x = np.mgrid[0:side, 0:side] / side
    rgb = np.stack([x, y, (x + y) / 2], -1) * 200 + np.random.default_rng(0).normal(0, noise, (side, side, 3))
    buf = io.BytesIO()
    Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).save(buf, format=fmt, quality=95)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--data", type=Path, default=data_place()[0])
    args = ap.parse_args()

    print(f"{'input':<10}" + "".join(f"{a:>12}" for a in digests.ALGORITHMS) + "   (GB/s)")
    for label, size, inner in (("1 MB", 1 << 20, 50), ("100 MB", 100 << 20, 1)):
        blob = np.random.default_rng(0).bytes(size)
        rates = [size / 1e9 / best(lambda: digests.image(blob, algorithm=a), args.repeats, inner)
                 for a in digests.ALGORITHMS]
        print(f"{label:<10}" + "".join(f"{r:>12.2f}" for r in rates))

    from transformers import CLIPImageProcessor

    proc = CLIPImageProcessor()
    frozen = digests.canonical(proc)
    images = {"synthetic 1400px.jpg": synthetic("JPEG", 1400, 14), "synthetic 800px.png": synthetic("PNG", 800, 4)}
    pngs = sorted((args.data / "mmmu" / "images").glob("*.png"), key=lambda p: p.stat().st_size)
    if pngs:
        images[f"mmmu/{pngs[-1].name}"] = pngs[-1].read_bytes()
    else:
        print(f"(no MMMU PNGs under {args.data}; real-image row skipped)")

    print(f"\n{'image':<38}{'bytes':>10}{'decode+prep ms':>16}{'digest ms':>11}{'ratio':>8}"
          f"{'frozen ms':>11}{'ratio':>8}")
    for name, data in images.items():
        prep = best(lambda: proc(images=digests.open_image(data).convert("RGB"), return_tensors="np"), args.repeats)
        dig = best(lambda: digests.image(data, proc), args.repeats, 20)
        dig_frozen = best(lambda: digests.image(data, frozen), args.repeats, 20)
        print(f"{name:<38}{len(data):>10,}{prep * 1e3:>16.2f}{dig * 1e3:>11.3f}{dig / prep:>8.4f}"
              f"{dig_frozen * 1e3:>11.3f}{dig_frozen / prep:>8.4f}")
    print("\ndigest: xxh3_128 of the file bytes + CLIPImageProcessor params (to_dict each call); "
          "frozen: params canonicalised once with digests.canonical(proc); ratio = digest / (decode + preprocess)")


if __name__ == "__main__":
    main()
