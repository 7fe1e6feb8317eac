"""GPU readiness check (prepared, NOT yet run: no GPU was available when it was written). One GPU, under 5 minutes.

1. Page gather/seed bandwidth on M*'s layout [layers, pages, 2, P, H, D] (a page is a dim-1 slice): copying
   reused pages into fresh ones with one ``index_select``/``index_copy_`` along dim 1 vs a plain device-to-device
   copy of the same bytes, in the same run (ratio; no non-contiguous staging copy is made).
2. Pool devices: a PagePool built on "cuda" accepts K/V on "cuda:0".
Not in it yet (left): the bit-exact gate in bf16 on CUDA and the drop-in under M*'s real FlashInfer path
(tests/test_mstar_cache_manager.py runs on the CPU only; it needs a device parameter first).

    python benchmarks/gpu_check.py
"""

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def bandwidth(layers=32, pages=4096, P=16, H=8, D=128, moved=512, runs=10):
    kv = torch.zeros(layers, pages, 2, P, H, D, dtype=torch.bfloat16, device="cuda")
    src = torch.randperm(pages, device="cuda")[:moved]
    dst = torch.randperm(pages, device="cuda")[:moved]
    flat = torch.empty(layers * moved * 2 * P * H * D, dtype=torch.bfloat16, device="cuda")
    flat_src = torch.randn_like(flat)

    def gather():
        kv.index_copy_(1, dst, kv.index_select(1, src))

    def plain():
        flat.copy_(flat_src)

    out = {}
    for name, fn in (("page gather+seed (dim 1)", gather), ("plain d2d copy", plain)):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(runs):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        out[name] = (min(ts), max(ts) / min(ts))
    nbytes = flat.numel() * flat.element_size()
    base = out["plain d2d copy"][0]
    print(f"{'copy':<28}{'GB/s':>8}{'spread':>8}{'vs plain':>10}")
    for name, (t, spread) in out.items():
        print(f"{name:<28}{nbytes / t / 1e9:>8.1f}{spread:>8.2f}{t / base:>10.2f}")


def devices():
    from mmcache.pool import PagePool, same_device
    pool = PagePool(4, (2, 2), torch.bfloat16, "cuda")
    assert same_device(pool.device, torch.zeros(1, device="cuda:0").device)
    print("PagePool('cuda') accepts tensors on cuda:0: ok")


def main():
    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA device")
    print(torch.cuda.get_device_name(0), torch.__version__)
    bandwidth()
    devices()


if __name__ == "__main__":
    main()
