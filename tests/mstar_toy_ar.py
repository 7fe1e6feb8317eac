"""A tiny autoregressive node over M*'s real resources (mstar-ai 0.2.1): its KV resource (M*'s ``KVManager``, or
mmcache's ``ReuseKVManager`` built from a ``ReuseKVSpec``) and its ``RopeManager``, both made by M*'s
``build_resource`` and driven by M*'s ``StepRunner`` (ingest, admit, plan, commit, remove) step by step as M*'s engine
drives them: prepare_inputs -> declare_step -> admit -> plan -> forward -> commit.

Only flashinfer's kernels are replaced: K/V go in through ``KVManager.write_kv`` (M*'s own write path) and attention
reads every position's K/V back from M*'s KV tensor through the plan's views (``SequenceView.page_idxs``), one query
row at a time (``attend``), with rotary positions from the ``RopeManager``'s planned position ids. ``dense_logits``
is the same model with no cache at all, the reference the stand-in is checked against.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import torch

from mstar_helpers import require_mstar

require_mstar()
from mstar.communication.tensors import LocalTransferEngine  # noqa: E402
from mstar.conductor.request_info import CurrentForwardPassInfo  # noqa: E402
from mstar.engine.resources import (  # noqa: E402
    KVConfig,
    KVSpec,
    KVStep,
    PositionConfig,
    PositionSpec,
    PositionStep,
    Segment,
    StepContext,
    StepRunner,
    SubmoduleStep,
)
from mstar.engine.resources.base import EngineResourceInfo, build_resource  # noqa: E402
from mstar.engine.resources.kv.transfer import TransferEngineInfo  # noqa: E402
from mstar.model.submodule_base import ARNodeInputs  # noqa: E402

from mmcache.mstar import fed_ids, kv_resource  # noqa: E402
from mmcache.mstar.kv_resource import PrefixReuse, ReuseKVSpec  # noqa: E402
from mmcache.mstar.switch import name_what_is_fed  # noqa: E402

V, D, H, HD, P = 128, 16, 2, 8, 4  # vocabulary, hidden, kv heads, head dim, page size
KV, ROPE, LABEL = "kv", "rope", "main"


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(V, D, generator=g, dtype=torch.float64),
            "wq": torch.randn(D, H * HD, generator=g, dtype=torch.float64) / 4,
            "wk": torch.randn(D, H * HD, generator=g, dtype=torch.float64) / 4,
            "wv": torch.randn(D, H * HD, generator=g, dtype=torch.float64) / 4,
            "wo": torch.randn(H * HD, V, generator=g, dtype=torch.float64) / 4}


def rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [n, H, HD] at positions ``pos`` [n] (the stand-in for flashinfer's RoPE)."""
    half = HD // 2
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    ang = pos.to(torch.float64)[:, None] * freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def project(w, ids: torch.Tensor, pos: torch.Tensor):
    """q, k, v [n, H, HD] of tokens ``ids`` at ``pos``, one row at a time (row results never depend on the batch)."""
    x = w["emb"][ids]
    rows = [(x[i] @ w["wq"], x[i] @ w["wk"], x[i] @ w["wv"]) for i in range(len(ids))]
    q, k, v = (torch.stack([r[j] for r in rows]).view(-1, H, HD) for j in range(3))
    return rotate(q, pos), rotate(k, pos), v


def attend(w, q_row: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal attention of one query [H, HD] over ``keys``/``values`` [t, H, HD], then the logits [V]."""
    scores = torch.einsum("hd,thd->ht", q_row, keys) / HD ** 0.5
    out = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
    return out.reshape(-1) @ w["wo"]


def dense_logits(w, ids: list[int]) -> torch.Tensor:
    """Every position's logits of ``ids`` with no cache: the reference."""
    t = torch.tensor(ids)
    q, k, v = project(w, t, torch.arange(len(ids)))
    return torch.stack([attend(w, q[i], k[:i + 1], v[:i + 1]) for i in range(len(ids))])


class ToyNode:
    """The node's submodule: ``prepare_inputs`` hands the step its ids (M*'s seam for prompts), ``declare_step`` one
    segment per request on ``LABEL``, ``forward`` writes K/V through M*'s ``write_kv`` and attends over the KV tensor.
    ``embed_walk``: a walk whose inputs are embeddings (no ids), as a multimodal prompt's middle walk is."""

    def __init__(self, w):
        self.w = w

    def prepare_inputs(self, graph_walk, fwd_info, inputs, resources=None, **kwargs):
        if graph_walk == "embed":
            n = int(inputs["embeds"].shape[0])
            return ARNodeInputs(input_embeds=inputs["embeds"], input_seq_len=n)  # its digest stays in ``inputs``
        ids = inputs["ids"]
        return ARNodeInputs(input_ids=ids, input_seq_len=int(ids.shape[0]))

    def declare_step(self, graph_walk, request_ids, inputs, *args, **kwargs):
        return SubmoduleStep(segments=[Segment(request_id=rid, label=LABEL, span=inp.input_seq_len)
                                       for rid, inp in zip(request_ids, inputs)],
                             steps={KV: KVStep(), ROPE: PositionStep()})

    def forward(self, kv, rope, inputs, plan) -> list[torch.Tensor]:
        """Last-position logits per request of this step."""
        pos = rope.pos_ids(LABEL)
        ids = [inp.input_ids if inp.input_ids is not None else inp.input_embeds for inp in inputs]
        flat = torch.cat(ids)
        if flat.dtype.is_floating_point:  # an embeddings walk: its rows stand in for embedded media
            x = flat.to(torch.float64)
            q = torch.stack([x[i] @ self.w["wq"] for i in range(len(x))]).view(-1, H, HD)
            k = torch.stack([x[i] @ self.w["wk"] for i in range(len(x))]).view(-1, H, HD)
            v = torch.stack([x[i] @ self.w["wv"] for i in range(len(x))]).view(-1, H, HD)
            q, k = rotate(q, pos), rotate(k, pos)
        else:
            q, k, v = project(self.w, flat, pos)
        kv.write_kv(k.to(kv.kv_cache.dtype), v.to(kv.kv_cache.dtype), layer_idx=0, label=LABEL)
        out, a = [], 0
        tensor = kv.kv_cache.tensor[0]  # [pages, 2, P, H, HD]
        for view in plan[KV][LABEL].views:
            pages = tensor[view.page_idxs]
            keys = pages[:, 0].reshape(-1, H, HD)[:view.length].to(torch.float64)
            values = pages[:, 1].reshape(-1, H, HD)[:view.length].to(torch.float64)
            last = a + view.to_compute - 1
            out.append(attend(self.w, q[last], keys, values))
            a += view.to_compute
        return out


@dataclasses.dataclass
class Node:
    """The resources and submodule of one node, as the engine holds them."""

    kv: object
    rope: object
    runner: StepRunner
    sub: ToyNode


def node(w, pages: int = 32, reuse: PrefixReuse | None = None, seam: bool = True, joint=None,
         dtype=torch.float64) -> Node:
    """A node built as M*'s engine builds one: specs -> ``build_resource`` -> ``StepRunner``; with ``reuse`` the KV
    spec is a ``ReuseKVSpec`` and the submodule carries the seam (``name_what_is_fed``)."""
    ranks = joint.world_size if joint is not None else 1  # M* shards KV heads over TP: each rank keeps H of them
    cfg = KVConfig(num_layers=1, num_kv_heads=H * ranks, head_dim=HD, max_seq_len=pages * P, max_num_pages=pages,
                   page_size=P)
    kv_spec = KVSpec(resource_key=KV, nodes={"toy"}, config=cfg)
    if reuse is not None:
        kv_spec = ReuseKVSpec.of(kv_spec, reuse)
    rope_spec = PositionSpec(resource_key=ROPE, nodes={"toy"}, config=PositionConfig(kv_cache=KV))
    info = EngineResourceInfo(device=torch.device("cpu"), joint_comm_group=joint, kv_dtype=dtype,
                              transfer_engine_info=TransferEngineInfo("e", "s", LocalTransferEngine("h")),
                              dependencies={KV: kv_spec})
    kv = build_resource(kv_spec, info)
    rope = build_resource(rope_spec, info)
    sub = ToyNode(w)
    if reuse is not None and seam:
        name_what_is_fed(sub, "toy", LABEL)
    return Node(kv, rope, StepRunner({KV: kv, ROPE: rope}), sub)


def fwd_info(rid: str, salt: bytes = b"") -> CurrentForwardPassInfo:
    return CurrentForwardPassInfo(request_id=rid, graph_walk="prefill", fwd_index=0, random_seed=0, max_tokens=0,
                                  step_metadata={"mmcache_salt": salt} if salt else {})


def step(n: Node, walk: str, feeds: dict[str, dict], salt: bytes = b""):
    """One engine step for the requests in ``feeds`` (rid -> the node's input tensors): prepare, declare, admit,
    plan, forward, commit. Returns (admit outcome, {rid: last logits}); a refused admit runs nothing."""
    rids = list(feeds)
    resources = {KV: n.kv, ROPE: n.rope}
    inputs = [n.sub.prepare_inputs(graph_walk=walk, fwd_info=fwd_info(rid, salt), inputs=feeds[rid],
                                   resources=resources) for rid in rids]
    s = n.sub.declare_step(walk, rids, inputs)
    s.set_ctx(StepContext(request_ids=rids, graph_walk=walk, slot=0, capture=False))
    outcome = n.runner.admit(s)
    if not outcome.ok:
        return outcome, {}
    plan = n.runner.plan(s)
    logits = n.sub.forward(n.kv, n.rope, inputs, plan)
    n.runner.commit(s)
    return outcome, dict(zip(rids, logits))


def ids_feed(ids) -> dict:
    return {"ids": torch.as_tensor(list(ids), dtype=torch.long)}


def serve(n: Node, rid: str, prompt: list[int], new: int, salt: bytes = b"", remove: bool = True):
    """Ingest, prefill ``prompt`` in one step, decode ``new`` greedy tokens one step each; returns (output ids, the
    logits of every step)."""
    n.runner.ingest_request(rid)
    outcome, got = step(n, "prefill", {rid: ids_feed(prompt)}, salt)
    assert outcome.ok, outcome
    logits, out = [got[rid]], []
    for _ in range(new):
        out.append(int(logits[-1].argmax()))
        outcome, got = step(n, "decode", {rid: ids_feed(out[-1:])}, salt)
        assert outcome.ok, outcome
        logits.append(got[rid])
    if remove:
        n.runner.remove_request(rid)
    return out, logits


def host_pool(n: Node, pages: int):
    """M*'s ``CPUPagePool`` for ``n``'s KV resource in plain host memory: M* pins it and copies on a CUDA stream, which
    a CPU cannot; the copies themselves are M*'s (its ``offload_stream`` / ``reload_stream``)."""
    from mstar.engine.resources.kv.cache import PageAllocator
    from mstar.engine.resources.kv.cpu_page_pool import CPUPagePool

    class HostPagePoolOnCPU(CPUPagePool):
        def __init__(self, config, kv_cache, max_cpu_pages):
            self.config, self.page_allocator = config, PageAllocator(max_cpu_pages)
            self.cpu_kv_cache = torch.zeros(config.num_layers, max_cpu_pages, 2, config.page_size,
                                            config.num_kv_heads, config.head_dim, dtype=kv_cache.dtype)
            self.offloaded, self._stream = {}, None

        def _get_stream(self):
            return None  # torch.cuda.stream(None) is a no-op: the copies run synchronously

        def sync(self):
            pass

    return HostPagePoolOnCPU(n.kv.config, n.kv.kv_cache, pages)


# -- decode ids as from a CUDA device (their copy to the host lands later) -------------------------------------------
class PendingCopy:
    """Stands in for the CUDA event of a copy to the host (``kv_resource.ids_to_host``): done when the schedule says
    so, or when waited for."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


@contextlib.contextmanager
def ids_as_from_a_device(copies: list):
    """The CPU ids of the toy node handled as ids on a CUDA device are: not joined when fed (``step_ids`` refuses
    them), and joined and copied to the host by ``ids_to_host``, the copy done only when its ``PendingCopy``
    (appended to ``copies``) says so; None where the real one refuses."""
    def start(streams):
        chunks = [chunk for stream in streams for chunk in stream]
        ids = fed_ids.one_tensor(chunks) if all(isinstance(c, torch.Tensor) for c in chunks) else None
        if ids is None:
            return None
        copies.append(PendingCopy())
        return ids.clone(), copies[-1]
    with mock.patch.object(kv_resource, "ids_to_host", start), \
            mock.patch.object(kv_resource, "step_ids", lambda ids: None):
        yield


# -- the same node under M*'s real Engine ---------------------------------------------------------------------------
def engine_node(w, pages: int = 32, reuse: PrefixReuse | None = None, dtype=torch.float64):
    """M*'s ``Engine`` (``load_model`` with the node's specs, ``warmup``) running ``ToyNode``'s computation as a real
    ``NodeSubmodule``; with ``reuse`` its KV spec is a ``ReuseKVSpec`` and the seam is on the node. Returns
    ``(engine, submodule)``."""
    from mstar.distributed.communication import WorkerParallelGroups
    from mstar.engine.engine import Engine
    from mstar.model.submodule_base import NodeSubmodule

    class ToyARSubmodule(NodeSubmodule):
        def __init__(self):
            super().__init__()
            self.toy = ToyNode(w)
            self.fed = 0  # prompt tokens the prefill walks computed
        def prepare_inputs(self, graph_walk, fwd_info, inputs, **kwargs):
            return ARNodeInputs(input_ids=inputs["ids"][0], input_seq_len=int(inputs["ids"][0].shape[0]))

        def declare_step(self, graph_walk, request_ids, inputs, *args, **kwargs):
            return self.toy.declare_step(graph_walk, request_ids, inputs)

        def preprocess(self, graph_walk, engine_inputs, inputs):
            return {"rows": list(inputs)}

        def can_batch(self, batch, model_inputs):
            return True

        def forward_batched(self, graph_walk, engine_inputs, rows):
            if graph_walk == "prefill":
                self.fed += sum(r.input_seq_len for r in rows)
            res = engine_inputs.resources
            logits = self.toy.forward(res[KV], res[ROPE], rows, engine_inputs.step.ctx.plan_results)
            return {rid: {"logits": [lg]} for rid, lg in zip(engine_inputs.request_ids, logits)}

        def forward(self, graph_walk, engine_inputs, rows):
            return self.forward_batched(graph_walk, engine_inputs, rows)[engine_inputs.request_ids[0]]

    cfg = KVConfig(num_layers=1, num_kv_heads=H, head_dim=HD, max_seq_len=pages * P, max_num_pages=pages, page_size=P)
    kv_spec = KVSpec(resource_key=KV, nodes={"toy"}, config=cfg)
    if reuse is not None:
        kv_spec = ReuseKVSpec.of(kv_spec, reuse)
    rope_spec = PositionSpec(resource_key=ROPE, nodes={"toy"}, config=PositionConfig(kv_cache=KV))
    sub = ToyARSubmodule()
    if reuse is not None:
        name_what_is_fed(sub, "toy", LABEL)
    engine = Engine(autocast_dtype=None)
    engine.load_model({"toy": sub}, specs=[kv_spec, rope_spec],
                      parallel_groups=WorkerParallelGroups(num_workers=1, global_rank=0), device=torch.device("cpu"),
                      transfer_engine_info=TransferEngineInfo("e", "s", LocalTransferEngine("h")), kv_cache_type=dtype)
    engine.warmup()
    return engine, sub


def engine_step(engine, walk: str, feeds: dict[str, list[int]], salt: bytes = b"") -> dict[str, torch.Tensor]:
    """One batch of the toy node on ``walk`` as M*'s worker runs it: prepare_inputs, exec_and_postprocess,
    finalize_batch. Returns rid -> last-position logits."""
    from mstar.engine.engine import ExecutingBatch
    infos = {rid: fwd_info(rid, salt) for rid in feeds}
    for info in infos.values():
        info.graph_walk = walk
    b = ExecutingBatch(node_name="toy", per_request_info=infos,
                       per_request_input_tensors={rid: {"ids": [torch.as_tensor(ids, dtype=torch.long)]}
                                                  for rid, ids in feeds.items()},
                       step_context=StepContext(request_ids=tuple(feeds), graph_walk=walk, slot=0, capture=False))
    engine.prepare_inputs(b)
    assert not b.failed_requests, b.failed_requests
    out = engine.exec_and_postprocess(b)
    engine.finalize_batch(b)
    return {rid: o["logits"][0] for rid, o in out.items()}
