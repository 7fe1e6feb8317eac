"""A tiny autoregressive model over M*'s cache manager (plan_attention, plan_rope, apply_rope, run_attention,
advance_seq_lens), and an M* AR node over it run by M*'s ``KVCacheEngine`` (``engine``, ``step``, ``serve``): the
model of the tests and benchmarks that drive M*'s own code on the CPU. Needs M* on the path (``mmcache.mstar``)
and the flashinfer stand-in installed as ``sys.modules["flashinfer"]`` before a step runs."""

import torch

import flashinfer_standin

L, H, D, V, P = 2, 2, 8, 61, 4
CPU = torch.device("cpu")


def lin(x, w):
    """A batch-invariant linear layer (elementwise product and a per-row sum), so a token's result never depends
    on which other tokens share its batch."""
    return (x[:, None, :] * w[None]).sum(-1)


class TinyAR:
    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
        self.emb = r(V, H * D)
        self.layers = [(r(H * D, H * D), r(H * D, H * D), r(H * D, H * D), r(H * D, H * D)) for _ in range(L)]
        self.out = r(V, H * D)

    def step(self, alloc, batch: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """One engine step through M*'s cache manager: each request appends ``batch[rid]``; returns its logits."""
        from mstar.engine.cache_manager import WorkspaceBufferManager, create_cache_manager
        rids = list(batch)
        cm = create_cache_manager(request_ids=rids, active_labels_per_request=dict.fromkeys(rids, "main"),
                                  kv_cache=alloc.kv_cache, alloc_manager=alloc,
                                  buffer_manager=WorkspaceBufferManager(1024, CPU), kv_cache_config=alloc.config,
                                  device=CPU, auto_write_store=False)
        return dict(zip(rids, self.forward(cm, list(batch.values()))))

    def forward(self, cm, ids: list) -> torch.Tensor:
        """Append ``ids[i]`` to the i-th request of ``cm``; the logits of each one's last token, [B, V]."""
        lens = [len(t) for t in ids]
        cm.plan_attention(seq_lens=lens, dtype=torch.float32)
        cm.plan_rope(lens)
        x = self.emb[torch.tensor([int(t) for seq in ids for t in seq])]
        for layer, (wq, wk, wv, wo) in enumerate(self.layers):
            q, k, v = (lin(x, w).view(-1, H, D) for w in (wq, wk, wv))
            q, k = cm.apply_rope(q, k, rope_dtype=torch.float32)
            x = x + lin(cm.run_attention(q, k, v, layer_idx=layer).reshape(-1, H * D), wo)
        cm.advance_seq_lens()
        logits = lin(x, self.out)
        return logits[torch.tensor(lens).cumsum(0) - 1]

    def dense(self, tokens: list[int]) -> torch.Tensor:
        """Logits of every position by plain causal attention over the whole sequence (no pages)."""
        x = self.emb[torch.tensor(tokens)]
        pos = torch.arange(len(tokens))
        for wq, wk, wv, wo in self.layers:
            q, k, v = (lin(x, w).view(-1, H, D) for w in (wq, wk, wv))
            flashinfer_standin.apply_rope_pos_ids_inplace(q, k, pos)
            a = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                                 v.transpose(0, 1), is_causal=True)
            x = x + lin(a.transpose(0, 1).reshape(-1, H * D), wo)
        return lin(x, self.out)


# ---------------------------------------------------------------------------------------------------------------------
# M*'s KVCacheEngine over TinyAR (imports M* lazily: importing this module needs only torch)
NODE, PAGES = "ar", 64


def _mstar():
    import mmcache.mstar  # noqa: F401  (puts M* on sys.path)
    from mstar.conductor.request_info import CurrentForwardPassInfo
    from mstar.distributed.communication import WorkerParallelGroups
    from mstar.engine.base import NodeBatch
    from mstar.engine.kv_cache_engine import KVCacheEngine
    from mstar.engine.kv_store import KVCacheConfig
    from mstar.model.submodule_base import ARNodeInputs, ARNodeSubmodule
    from mstar.utils.sampling import MultiSamplingConfig, SamplingConfig
    return locals()


def submodule_class():
    m = _mstar()
    ARNodeInputs = m["ARNodeInputs"]  # noqa: N806

    class TinyARSubmodule(m["ARNodeSubmodule"]):
        """An M* AR node over ``TinyAR``. Input "ids": the tokens to append this step. On a label's first prefill,
        ``prepare_inputs`` asks the drop-in for the cached prefix and feeds only the rest (the seam); sampled tokens
        reach it through ``postprocess`` -> ``append_tokens``. Every step's logits are kept in ``log``."""

        def __init__(self, model: TinyAR):
            super().__init__()
            self.model, self.alloc, self.log, self.matched = model, None, [], {}

        def prepare_inputs(self, graph_walk, fwd_info, inputs, seen_token_mask, pos_info={}):
            rid, ids = fwd_info.request_id, inputs["ids"][0]
            state = self.alloc.get_state(rid, "main")
            if not state.page_indices and not state.seq_len and hasattr(self.alloc, "match_prefix"):
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
            if "new_token" in outputs and hasattr(self.alloc, "append_tokens"):
                self.alloc.append_tokens(request_id, "main", outputs["new_token"][0].view(-1).tolist())

    return TinyARSubmodule


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


def engine(model, reuse: bool, drop_in: bool = True, pages: int = PAGES):
    """A loaded ``KVCacheEngine`` with one TinyAR node on the CPU (greedy), and its submodule; the allocator is the
    drop-in (reuse on or off) or, with ``drop_in=False``, M*'s own manager."""
    from mstar_helpers import local_transfer
    m = _mstar()
    cfg = m["KVCacheConfig"](num_layers=L, num_kv_heads=H, head_dim=D, max_seq_len=pages * P, max_num_pages=pages,
                             page_size=P)
    sub = submodule_class()(model)
    eng = m["KVCacheEngine"](autocast_dtype=torch.float32)
    greedy = m["MultiSamplingConfig"](m["SamplingConfig"](vocab_size=V, temperature=0.0))
    eng.load_model({NODE: sub}, m["WorkerParallelGroups"](num_workers=1, global_rank=0), [cfg], CPU,
                   local_transfer(), {NODE: greedy}, kv_cache_type=torch.float32)
    eng.submodule_management[NODE].sampler = GreedySampler()
    if drop_in:
        from mmcache import Fingerprint
        from mmcache.mstar import PrefixReuse, install
        spec = PrefixReuse(Fingerprint("tiny-ar", page_size=P)) if reuse else None
        (sub.alloc,) = install(eng, spec).values()
    else:  # M*'s own manager (no match_prefix: reuse is off)
        sub.alloc = eng.kv_management[cfg.get_node_str()].alloc_manager
    return eng, sub


def step(eng, feeds: dict[str, list[int]]) -> dict[str, int]:
    """One ``execute_batch`` + ``finalize_batch`` of the requests in ``feeds``; returns their sampled tokens."""
    m = _mstar()
    infos = {rid: m["CurrentForwardPassInfo"](rid, "w", False, 0, 0, 64, {}) for rid in feeds}
    inputs = {rid: {"ids": [torch.tensor(t)]} for rid, t in feeds.items()}
    batch = m["NodeBatch"](NODE, "w", list(feeds), inputs, infos)
    try:
        out = eng.execute_batch(batch)
    finally:
        eng.finalize_batch(batch)
    assert not out.allocation_failed and not out.failed_requests, (out.alloc_pages_short, out.failed_requests)
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


