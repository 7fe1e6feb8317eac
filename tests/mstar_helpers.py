"""Helpers for the tests that drive the real M* code (../shared/vendor/mstar or $MMCACHE_MSTAR): building M*'s
manager and the drop-in on the CPU, and a CPU stand-in for M*'s CPUPagePool (which pins memory and needs CUDA).
Test modules call ``require_mstar()`` first: it skips the module with a reason when M* or its deps are missing."""

import importlib.util
import threading

import pytest
import torch


def require_mstar():
    from mmcache.mstar.vendor import mstar_root
    if mstar_root() is None:
        pytest.skip("M* source not found: set MMCACHE_MSTAR or place it at ../shared/vendor/mstar",
                    allow_module_level=True)
    for dep in ("zmq", "msgpack", "yaml"):
        if importlib.util.find_spec(dep) is None:
            pytest.skip(f"M*'s import dependency {dep!r} is missing: pip install -e '.[mstar]'",
                        allow_module_level=True)
    from mmcache.mstar.vendor import import_mstar
    import_mstar()  # puts M* on sys.path


def config(max_num_pages=16, page_size=4, num_layers=1, num_kv_heads=1, head_dim=2):
    from mstar.engine.kv_store import KVCacheConfig
    return KVCacheConfig(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         max_seq_len=max_num_pages * page_size, max_num_pages=max_num_pages, page_size=page_size)


def kv_tensor(cfg, dtype=torch.float32):
    """M*'s KV layout: [layers, pages, 2, page_size, kv_heads, head_dim]."""
    return torch.zeros(cfg.num_layers, cfg.max_num_pages, 2, cfg.page_size, cfg.num_kv_heads, cfg.head_dim,
                       dtype=dtype)


def local_transfer():
    from mstar.communication.tensors import LocalTransferEngine
    from mstar.engine.kv_store import TransferEngineInfo
    return TransferEngineInfo("h", "h", LocalTransferEngine("h"))


def mstar_manager(cfg, kv_cache, monkeypatch):
    """M*'s own manager on the CPU: its CUDA-IPC transfer engine is swapped (in this test only) for in-process
    CPU reads, the one thing that keeps its constructor off a CPU-only machine."""
    from mstar.engine import kv_store
    from mmcache.mstar.allocator import CPUKVTransferEngine
    monkeypatch.setattr(kv_store, "CudaIpcKVTransferEngine", lambda kv, max_workers=3: CPUKVTransferEngine(kv))
    return kv_store.PagedAllocationManager(cfg, kv_cache, local_transfer())


def dropin_manager(cfg, kv_cache, reuse=False, **kwargs):
    from mmcache import Fingerprint
    from mmcache.mstar import PrefixPagedAllocationManager, PrefixReuse
    spec = PrefixReuse(Fingerprint("tiny", page_size=cfg.page_size)) if reuse is True else (reuse or None)
    return PrefixPagedAllocationManager(cfg, kv_cache, local_transfer(), reuse=spec, **kwargs)


def make_manager(kind, monkeypatch, max_num_pages=16, page_size=4):
    """``kind``: "mstar" (M*'s manager), "dropin" (reuse off) or "reuse" (drop-in, reuse on)."""
    cfg = config(max_num_pages, page_size)
    kv = kv_tensor(cfg)
    if kind == "mstar":
        return mstar_manager(cfg, kv, monkeypatch)
    return dropin_manager(cfg, kv, reuse=(kind == "reuse"))


def cpu_page_pool(cfg, pages, dtype=torch.float32):
    """M*'s CPUPagePool with unpinned memory and no side stream (both need CUDA); every method is M*'s."""
    from mstar.engine.cpu_page_pool import CPUPagePool
    from mstar.engine.kv_store import PageAllocator

    class CPUOnlyPagePool(CPUPagePool):
        def __init__(self):
            self.config, self.page_allocator, self.offloaded, self._stream = cfg, PageAllocator(pages), {}, None
            self.cpu_kv_cache = torch.zeros(cfg.num_layers, pages, 2, cfg.page_size, cfg.num_kv_heads, cfg.head_dim,
                                            dtype=dtype)

        def _get_stream(self):
            return None  # torch.cuda.stream(None) is a no-op context: copies run on the CPU, synchronously

    return CPUOnlyPagePool()


def free_pages(manager) -> int:
    return manager.page_allocator.num_free


def held_pages(manager) -> int:
    return sum(len(s.page_indices) for labels in manager.request_states.values() for s in labels.values())


__all__ = ["threading"]


def assert_same_steps(on: list[dict], off: list[dict], steps: int) -> None:
    """Reuse on vs off, step by step: the same requests in each step and their logits bit-equal (``torch.equal``)."""
    assert len(on) == len(off) == steps
    for a, b in zip(on, off):
        assert a.keys() == b.keys()
        for rid in a:
            assert torch.equal(a[rid], b[rid]), rid
