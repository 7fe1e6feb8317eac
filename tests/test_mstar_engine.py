"""M*'s ``KVCacheEngine`` end to end over the drop-in (load_model, install, add_request, execute_batch,
finalize_batch, remove_request) with a tiny AR submodule on the CPU: several requests per batch, later requests
reusing earlier ones' prompt and generated pages, every step's logits torch.equal to reuse off on the same
chunk schedule. The reuse seam is the submodule's ``prepare_inputs`` (where M* has the prompt ids)."""

import pytest
import torch

import flashinfer_standin
from mstar_helpers import local_transfer, require_mstar
from mstar_tiny_ar import TinyAR, H, L, D, P, V, CPU

require_mstar()

from mstar.conductor.request_info import CurrentForwardPassInfo  # noqa: E402
from mstar.distributed.communication import WorkerParallelGroups  # noqa: E402
from mstar.engine.base import NodeBatch  # noqa: E402
from mstar.engine.kv_cache_engine import KVCacheEngine  # noqa: E402
from mstar.engine.kv_store import KVCacheConfig  # noqa: E402
from mstar.model.submodule_base import ARNodeInputs, ARNodeSubmodule  # noqa: E402
from mstar.utils.sampling import MultiSamplingConfig, SamplingConfig  # noqa: E402

from mmcache import Fingerprint  # noqa: E402
from mmcache.mstar import PrefixReuse, install  # noqa: E402

NODE, PAGES = "ar", 64


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    """The flashinfer stand-in, and M*'s CUDA-IPC transfer engine swapped for in-process reads (in this test only):
    ``load_model`` builds M*'s own manager first, whose constructor needs CUDA only for that engine."""
    from mstar.engine import kv_store
    from mmcache.mstar.allocator import CPUKVTransferEngine
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", flashinfer_standin.module())
    monkeypatch.setattr(kv_store, "CudaIpcKVTransferEngine", lambda kv, max_workers=3: CPUKVTransferEngine(kv))


class TinyARSubmodule(ARNodeSubmodule):
    """An M* AR node over ``TinyAR``. Input "ids": the tokens to append this step. On a label's first prefill,
    ``prepare_inputs`` asks the drop-in for the cached prefix and feeds only the rest (the seam); sampled tokens
    reach it through ``postprocess`` -> ``append_tokens``. Every step's logits are kept in ``log``."""

    def __init__(self, model: TinyAR):
        super().__init__()
        self.model, self.alloc, self.log, self.matched = model, None, [], {}

    def prepare_inputs(self, graph_walk, fwd_info, inputs, seen_token_mask, pos_info={}):
        rid, ids = fwd_info.request_id, inputs["ids"][0]
        state = self.alloc.get_state(rid, "main")
        if not state.page_indices and not state.seq_len:
            k = self.matched[rid] = self.alloc.match_prefix(rid, "main", ids.tolist())
            ids = ids[k:]
        return ARNodeInputs(input_seq_len=len(ids), input_ids=ids)

    def preprocess(self, graph_walk, engine_inputs, inputs):
        return {"ids": [inp.input_ids for inp in inputs]}

    def can_batch(self, batch, model_inputs):
        return True

    def forward_batched(self, graph_walk, engine_inputs, ids):
        logits = self.model.forward(engine_inputs.cache_manager, ids)
        self.log.append(dict(zip(engine_inputs.request_ids, logits)))
        return {rid: {"logits": [logits[i:i + 1]]} for i, rid in enumerate(engine_inputs.request_ids)}

    def postprocess(self, request_id, request_info, outputs, inputs=None, **kwargs):
        if "new_token" in outputs:
            self.alloc.append_tokens(request_id, "main", outputs["new_token"][0].view(-1).tolist())


class GreedySampler:
    """A CPU stand-in for M*'s ``MultiSampler``, whose kernels are Triton + flashinfer (CUDA only): greedy argmax,
    the same interface the engine calls."""

    def add_request(self, rid):
        pass

    remove_request = add_request

    def set_config(self, rid, config):
        pass

    def get_token_mask(self, rid):
        return None

    def sample(self, request_ids, logits):
        return logits.argmax(-1)


def engine(model, reuse: bool):
    cfg = KVCacheConfig(num_layers=L, num_kv_heads=H, head_dim=D, max_seq_len=PAGES * P, max_num_pages=PAGES,
                        page_size=P)
    sub = TinyARSubmodule(model)
    eng = KVCacheEngine(autocast_dtype=torch.float32)
    greedy = MultiSamplingConfig(SamplingConfig(vocab_size=V, temperature=0.0))
    eng.load_model({NODE: sub}, WorkerParallelGroups(num_workers=1, global_rank=0), [cfg], CPU, local_transfer(),
                   {NODE: greedy}, kv_cache_type=torch.float32)
    eng.submodule_management[NODE].sampler = GreedySampler()
    spec = PrefixReuse(Fingerprint("tiny-ar", page_size=P)) if reuse else None
    (sub.alloc,) = install(eng, spec).values()
    return eng, sub


def step(eng, feeds: dict[str, list[int]]) -> dict[str, int]:
    """One ``execute_batch`` + ``finalize_batch`` of the requests in ``feeds``; returns their sampled tokens."""
    infos = {rid: CurrentForwardPassInfo(rid, "w", False, 0, 0, 64, {}) for rid in feeds}
    batch = NodeBatch(NODE, "w", list(feeds), {rid: {"ids": [torch.tensor(t)]} for rid, t in feeds.items()}, infos)
    try:
        out = eng.execute_batch(batch)
    finally:
        eng.finalize_batch(batch)
    assert not out.allocation_failed and not out.failed_requests
    return {rid: int(out.per_request_output_tensors[rid]["new_token"][0]) for rid in feeds}


def serve(eng, prompts, decode, chunks=None):
    """Prefill ``prompts`` (in ``chunks``: token cut points per request and step; default one step), decode
    greedily, remove. Returns every request's tokens."""
    for rid in prompts:
        eng.add_request(rid, ["main"])
    cuts = {rid: list((chunks or {}).get(rid, [])) + [len(ids)] for rid, ids in prompts.items()}
    done, nxt = dict.fromkeys(prompts, 0), {}
    for i in range(max(map(len, cuts.values()))):
        feeds = {rid: prompts[rid][done[rid]:cuts[rid][i]] for rid in prompts if cuts[rid][i] > done[rid]}
        nxt.update(step(eng, feeds))
        done.update({rid: cuts[rid][i] for rid in feeds})
    tokens = {rid: list(ids) for rid, ids in prompts.items()}
    for _ in range(decode):
        for rid, t in nxt.items():
            tokens[rid].append(t)
        nxt = step(eng, {rid: [t] for rid, t in nxt.items()})
    for rid in prompts:
        eng.remove_request(rid)
    return tokens


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
    on, off = runs[True][1], runs[False][1]
    assert len(on) == len(off) == 4
    for a, b in zip(on, off):
        assert a.keys() == b.keys()
        for rid in a:
            assert torch.equal(a[rid], b[rid]), rid
