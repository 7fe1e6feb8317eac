"""First-request fingerprint time at two checkpoint sizes: every weight's bytes (``module_fingerprint``, the old
default) against the checkpoint files' identity and a sample (``weights_fingerprint``, the new one).

    python benchmarks/bench_fingerprint.py [--sizes 32,512] [--repeats 5] [--device cuda|cpu] [--dtype bfloat16]

A umT5-style text encoder (``T5EncoderModel``, random weights, the family of Wan's 11 GiB text encoder) of 8
layers, as wide as makes about each size in MiB (so every size has the same tensors, only larger), is saved with
``save_pretrained`` to a temporary folder and loaded back with ``from_pretrained`` onto ``--device`` (default: cuda
when there is one). Each fingerprint call is a first request: nothing is kept between calls (the folder is read
again, the sample compared again). The files were just written, so they are in the page cache: a cold disk adds its
latency to the new route's four small reads per tensor, not a read of the weights. The last column is what a
content hash of the files on disk would cost (xxh3 over every byte: the first run of a per-machine sidecar cache),
for comparison. Seconds are best / median of ``--repeats``; old/new is the ratio of the medians.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from digests.digest import hasher, update_from_file  # noqa: E402
from mmcache.module_fingerprint import module_fingerprint  # noqa: E402
from mmcache.weights_fingerprint import weights_fingerprint  # noqa: E402


def t5_config(mib: int, dtype: torch.dtype, layers: int = 8):
    """A umT5-shaped encoder config of ``layers`` layers whose weights take about ``mib`` MiB in ``dtype``: the width
    grows with the size, the tensor count stays (the new route's cost is per tensor, not per byte)."""
    from transformers import UMT5Config
    vocab, params = 4096, mib * 2**20 / dtype.itemsize
    per_d2 = layers * (4 + 3 * 11 / 4)  # attention q, k, v, o and the gated FFN (d_ff = 2.75 d), per layer
    d = (-vocab + (vocab * vocab + 4 * per_d2 * params) ** 0.5) / (2 * per_d2)
    d_model = max(64, round(d / 64) * 64)
    return UMT5Config(vocab_size=vocab, d_model=d_model, d_kv=64, d_ff=d_model * 11 // 4, num_layers=layers,
                      num_heads=d_model // 64, feed_forward_proj="gated-gelu", dtype=dtype)


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """Best and median seconds of ``repeats`` calls of ``fn`` (after one untimed call), and its result."""
    out = fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times), out


def content_hash(folder: Path) -> bytes:
    h = hasher()
    for f in sorted(folder.iterdir()):
        update_from_file(h, f)
    return h.digest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32,512", help="checkpoint sizes in MiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    from transformers import T5EncoderModel
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    print(f"# {platform.node()} | {platform.platform()} | {os.cpu_count()} CPUs | torch {torch.__version__} | "
          f"weights on {args.device} ({device_name}) | {args.dtype} | best/median of {args.repeats}")
    print(f"{'checkpoint':>12}{'tensors':>9}{'every byte (old) s':>22}{'checkpoint (new) s':>22}{'old/new':>9}"
          f"{'file content hash s':>22}")
    for mib in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(0)
            T5EncoderModel(t5_config(mib, dtype)).to(dtype).save_pretrained(tmp)
            model = T5EncoderModel.from_pretrained(tmp, dtype=dtype).to(args.device)
            on_disk = sum(f.stat().st_size for f in Path(tmp).iterdir()) / 2**20
            old_best, old_med, old = timed(functools.partial(module_fingerprint, model), args.repeats)
            new_best, new_med, new = timed(functools.partial(weights_fingerprint, model), args.repeats)
            assert new != old, "the checkpoint route was not taken"
            file_best, file_med, _ = timed(lambda: content_hash(Path(tmp)), args.repeats)
            print(f"{on_disk:>8.0f} MiB{len(model.state_dict()):>9}{old_best:>11.4f} / {old_med:<8.4f}"
                  f"{new_best:>11.4f} / {new_med:<8.4f}{old_med / new_med:>8.1f}x"
                  f"{file_best:>11.4f} / {file_med:<8.4f}")
            del model
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
