"""M*'s ``KVCacheEngine`` end to end over the drop-in (load_model, install, add_request, execute_batch,
finalize_batch, remove_request) with a tiny AR submodule on the CPU: several requests per batch, later requests
reusing earlier ones' prompt and generated pages, every step's logits torch.equal to reuse off on the same
chunk schedule. The reuse seam is the submodule's ``prepare_inputs`` (where M* has the prompt ids)."""

import pytest

import flashinfer_standin
from mstar_helpers import assert_same_steps, require_mstar
from mstar_tiny_ar import PAGES, TinyAR, engine, serve

require_mstar()


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    """The flashinfer stand-in, and M*'s CUDA-IPC transfer engine swapped for in-process reads (in this test only):
    ``load_model`` builds M*'s own manager first, whose constructor needs CUDA only for that engine."""
    from mstar.engine import kv_store
    from mmcache.mstar.allocator import CPUKVTransferEngine
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", flashinfer_standin.module())
    monkeypatch.setattr(kv_store, "CudaIpcKVTransferEngine", lambda kv, max_workers=3: CPUKVTransferEngine(kv))


@pytest.mark.filterwarnings("ignore:User provided device_type of .cuda.")  # M* autocasts "cuda" on any device
def test_engine_reuse_is_bit_equal_to_reuse_off_on_the_same_schedule():
    model = TinyAR()
    first = {"a": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], "b": [2, 7, 1, 8, 2, 8, 1, 8, 2]}
    runs = {}
    for reuse in (True, False):
        eng, sub = engine(model, reuse)
        toks = serve(eng, first, decode=3)
        later = {"c": toks["a"][:12] + [11, 12, 13], "d": first["b"][:8] + [40, 41, 42, 43], "e": [5, 5, 5, 5, 5]}
        n = len(sub.log)
        if reuse:
            out = serve(eng, later, decode=3)
            assert {r: sub.matched[r] for r in later} == {"c": 12, "d": 8, "e": 0}  # a's generated pages too
        else:  # recompute what the cached run skipped in the chunks it was first computed in (a: prefill of 10,
            # then two decode steps; d's 8: b's prefill); e sits those steps out
            out = serve(eng, later, decode=3, chunks={"c": [10, 11, 12], "d": [8, 8, 8], "e": [0, 0, 0]})
            n += 3
        runs[reuse] = (out, sub.log[n:])
        alloc = sub.alloc
        assert alloc.pool.num_free + sum(len(i) for i in alloc.indexes.values()) == PAGES
    assert runs[True][0] == runs[False][0]
    assert_same_steps(runs[True][1], runs[False][1], steps=4)
