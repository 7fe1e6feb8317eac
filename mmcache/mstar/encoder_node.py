"""``CachedEncoderNode``: any M* encoder ``NodeSubmodule`` behind an ``EncoderStore`` (RFC phase 3a inside M*).

The wrapper is what M*'s ``Engine`` (0.2.1) holds in place of the node (``cache_encoder_nodes``); an encoder node
declares no step (no engine resource), so the engine runs ``prepare_inputs -> preprocess -> forward_batched`` on it
and ``cleanup_request`` when it removes a request. Per batch:

- ``prepare_inputs`` runs the node's own, then splits each request into items (``NodeItems``: one item per request
  for most encoders; the Wan 2.2 text encoder has two, the prompt and the CFG negative), each with its key;
- ``forward_batched`` takes every item whose key the store holds from the store (the node does not run for it);
  the remaining items, one per distinct key, run as ONE sub-batch through the node's real ``preprocess`` and
  ``forward_batched`` (or ``forward`` per item when the node cannot batch, as the engine itself would) and are
  stored; items of the same key, in this batch or in a concurrent caller of the same store (another node, an
  ``encoders`` wrapper), wait for that one computation and get private copies: the store's one single-flight table
  (``EncoderStore.get_or_compute_many``);
- every output a request received stays pinned in the store until ``cleanup_request`` (the engine calls it when it
  removes the request).

Invariants: a request's outputs are bit-identical to the node's own (a hit is a copy of the bytes a miss computed for
the same key, and a miss runs the node's forward on the same per-item inputs); no two requests share a tensor; keys
carry the node's fingerprint, the request's tenant salt (``mmcache.mstar.salts``) and (unless
``NodeItems.walk_sensitive`` is False) the graph walk.

Counting: each distinct key of a batch is one store query (a hit or a miss); a key that another caller is computing
is a join (this node's ``joins``); items repeating a key inside one batch are joins too.

Nodes that declare a step (they own engine resources: attention, KV) are refused: their forward depends on resource
state that a stored output would not replay. No CUDA graph of the node is captured through the wrapper (whole-node or
piecewise): the misses run eager.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Callable, Protocol, Sequence

from mmcache.encoder_key import EncoderKey
from mmcache.encoder_pin import EncoderPin
from mmcache.encoder_store import EncoderStore
from mmcache.errors import InvalidRequest
from mmcache.eviction import check_policy
from mmcache.mstar.requirement import require_mstar
from mmcache.mstar.salts import request_salt
from mmcache.weights_fingerprint import weights_fingerprint

require_mstar()

from mstar.engine.engine import ExecutingBatch  # noqa: E402
from mstar.engine.resources import StepContext  # noqa: E402
from mstar.model.submodule_base import ModelInputsFromEngine, NodeInputs, NodeSubmodule  # noqa: E402

DEFAULT_CAPACITY = 1 << 30


@dataclasses.dataclass(frozen=True)
class Item:
    """One cacheable piece of a request: its digest (and verifying ids), the node inputs that compute it alone, and
    how its value is taken out of the outputs of a forward on those inputs. Its key takes the request's salt from
    ``step_metadata`` unless ``salted`` (``mmcache.mstar.salts``)."""

    digest: bytes
    inputs: NodeInputs
    select: Callable[[dict], Any] = lambda outputs: outputs
    verify_ids: Any = None
    salted: bool = False  # the digest already carries the request's tenant salt (folded in by the data worker)


class NodeItems(Protocol):
    """How a node's per-request inputs split into items and how item values make the request's outputs."""

    modality: str
    walk_sensitive: bool

    def items(self, fwd_info, raw_inputs: dict, node_inputs: NodeInputs) -> list[Item]:
        ...

    def assemble(self, node_inputs: NodeInputs, values: list) -> dict:
        ...


@dataclasses.dataclass
class NodeCounters:
    """This node's lookups since creation: items served from the store, computed, or joined onto another's
    computation (the encoder seconds the hits saved are the store's ``time_saved_s``, per modality)."""

    hits: int = 0
    misses: int = 0
    joins: int = 0
    forward_items: int = 0  # items the node's forward computed
    forward_calls: int = 0  # sub-batches run (one per batch with a miss)


def _salt(fwd_info) -> bytes:
    return request_salt(getattr(fwd_info, "step_metadata", None), "step_metadata")


@dataclasses.dataclass(eq=False)
class _Prepared:
    """The wrapper's per-request ``NodeInputs.kwargs['prepared']``: the node's own inputs and the keyed items."""

    rid: str
    fwd_info: Any
    inner: NodeInputs
    items: list[Item]
    keys: list[EncoderKey]


class CachedEncoderNode(NodeSubmodule):
    """``node`` (an M* ``NodeSubmodule``) with its outputs reused across requests through ``store``.

    ``items`` says how requests split into keyed items (``WholeRequest`` or a model's own, see
    ``mmcache.mstar.encoder_items``). ``store``: pass a shared one (e.g. one on the node's KV pool); by default the
    node gets a store of its own of ``capacity_bytes`` on the node's device, evicting by ``eviction`` (a name in
    ``mmcache.eviction.POLICIES``, None for the default; ``InvalidConfig`` here for an unknown one; not with
    ``store``, which evicts by its pool's). ``fingerprint``: what names the node's weights (default:
    ``mmcache.weights_fingerprint`` of the node, from the checkpoint folders in ``checkpoints`` and those its configs
    name, without reading the weights; every weight's bytes where no checkpoint names them), taken once, on first use.
    """

    disable_torch_compile = True  # the engine would compile ``forward``; this wrapper dispatches in forward_batched

    def __init__(self, node: NodeSubmodule, items: NodeItems, store: EncoderStore | None = None, *,
                 capacity_bytes: int = DEFAULT_CAPACITY, page_bytes: int = 65536, fingerprint: str | None = None,
                 eviction: str | None = None, checkpoints: Sequence[str | os.PathLike] = ()):
        if not isinstance(node, NodeSubmodule):
            raise InvalidRequest(f"CachedEncoderNode wraps an M* NodeSubmodule, got {type(node).__name__}")
        if type(node).declare_step is not NodeSubmodule.declare_step:
            raise InvalidRequest(f"{type(node).__name__} declares engine steps (it owns resources such as KV or "
                                 f"attention): its outputs are not a function of its inputs alone")
        if eviction is not None:
            if store is not None:
                raise InvalidRequest("a given store evicts by its pool's policy: give eviction or store, not both")
            check_policy(eviction)
        super().__init__()
        self.node, self.spec = node, items
        self.request_states = node.request_states  # one state table: the engine's view and the node's agree
        self.disable_autocast = node.disable_autocast  # the engine reads it off the submodule it holds
        self._store, self._own_store, self._store_size = store, store is None, (capacity_bytes, page_bytes)
        self._eviction = eviction
        self._given_fingerprint, self._fingerprint, self._checkpoints = fingerprint, None, tuple(checkpoints)
        self.counters = NodeCounters()
        self._lock = threading.RLock()
        self._pins: dict[str, list[EncoderPin]] = {}

    @property
    def store(self) -> EncoderStore:
        """The store: the one given, else one of this node's own, made on first use on the node's device then."""
        with self._lock:
            if self._store is None:
                self._store = EncoderStore(*self._store_size, device=self.node.get_device(), eviction=self._eviction)
            return self._store

    @property
    def fingerprint(self) -> tuple:
        """What names the node's weights (the one given, else ``weights_fingerprint``, taken on first use: after M*
        moved and cast the node) and the item split."""
        with self._lock:
            if self._fingerprint is None:
                given = self._given_fingerprint
                if given is None:
                    given = weights_fingerprint(self.node, folders=self._checkpoints)
                self._fingerprint = (given, type(self.spec).__name__)
            return self._fingerprint

    def to(self, *args, **kwargs):
        """Move/cast the node through its own ``to`` (Pi0.5's and Wan 2.2's keep their fp32 islands there), as M*'s
        engine manager does right after ``get_submodule``. The fingerprint is taken anew (entries named by the old
        one can no longer match); an own store that already holds outputs cannot follow: InvalidRequest."""
        with self._lock:
            if self._own_store and self._store is not None:
                if len(self._store):
                    raise InvalidRequest("a CachedEncoderNode whose own store holds outputs cannot be moved: wrap the "
                                         "moved node anew")
                self._store = None
            moved = self.node.to(*args, **kwargs)
            if moved is not self.node:
                raise InvalidRequest(f"{type(self.node).__name__}.to returned another module")
            self._fingerprint = None
        return self

    # -- what the engine calls ----------------------------------------------------------------------------------------
    def bind_node_resources(self, resources: dict) -> None:
        super().bind_node_resources(resources)  # binds the node's layers (they are this module's too)
        self.node.node_resources = resources

    def prepare_inputs(self, graph_walk, fwd_info, inputs, **kwargs):
        inner = self.node.prepare_inputs(graph_walk=graph_walk, fwd_info=fwd_info, inputs=inputs, **kwargs)
        if inner is None:
            return None
        items = self.spec.items(fwd_info, inputs, inner)
        fp = (self.fingerprint, graph_walk) if self.spec.walk_sensitive else self.fingerprint
        salt = _salt(fwd_info)
        keys = [EncoderKey(it.digest, fp, self.spec.modality, b"" if it.salted else salt, it.verify_ids)
                for it in items]
        return NodeInputs(kwargs={"prepared": _Prepared(fwd_info.request_id, fwd_info, inner, items, keys)},
                          input_seq_len=inner.input_seq_len)

    def can_batch(self, batch, model_inputs):
        return True  # always: forward_batched splits hits from misses and runs the node the way it can

    def preprocess(self, graph_walk, engine_inputs, inputs):
        return {"prepared": [inp.kwargs["prepared"] for inp in inputs]}

    def forward(self, graph_walk, engine_inputs, prepared, **kwargs):
        return self.forward_batched(graph_walk, engine_inputs, prepared=prepared)[engine_inputs.request_ids[0]]

    def forward_batched(self, graph_walk, engine_inputs, prepared: list[_Prepared], **kwargs):
        """Per request id, its outputs: hits from the store, misses computed as one sub-batch and stored."""
        values = self._resolve(graph_walk, engine_inputs, prepared)
        out, at = {}, 0
        for p in prepared:
            out[p.rid] = self.spec.assemble(p.inner, values[at:at + len(p.items)])
            at += len(p.items)
        return out

    def filter_batched_output(self, request_info, outputs):
        return self.node.filter_batched_output(request_info, outputs)

    def postprocess(self, request_id, request_info, outputs, inputs=None, **kwargs):
        inner = inputs.kwargs["prepared"].inner if inputs is not None else None
        return self.node.postprocess(request_id, request_info, outputs, inputs=inner, **kwargs)

    def check_stop(self, request_id, request_info, outputs):
        return self.node.check_stop(request_id, request_info, outputs)

    def cleanup_request(self, request_id: str):
        """Release the request's pins, then the node's own per-request cleanup (which drops its shared state)."""
        with self._lock:
            pins = self._pins.pop(request_id, [])
        for pin in pins:
            pin.release()
        self.node.cleanup_request(request_id)

    def max_batch_size(self, graph_walk):
        return self.node.max_batch_size(graph_walk)

    def get_autocast_dtype(self):
        return self.node.get_autocast_dtype()

    # get_cuda_graph_configs and get_piecewise_cuda_graph_configs stay the base's: a whole-node replay would bypass
    # the lookup, and a piecewise region leases its slot (and declares its steps on the node's resources) before the
    # forward, which a hit skips. The node's misses run eager (BAGEL's ViT region is off by default anyway).

    def hold(self, request_id: str, digest: bytes, graph_walk: str) -> bool:
        """Whether the store holds the output of a one-item request carrying ``digest`` (``WholeRequest`` keys, the
        salt folded in) on
        ``graph_walk``; if so it is pinned for ``request_id`` until ``cleanup_request`` (the presence oracle of
        ``mmcache.mstar.decode_skip``: what it reports cannot be evicted before the node looks it up)."""
        fp = (self.fingerprint, graph_walk) if self.spec.walk_sensitive else self.fingerprint
        pin = self.store.pin(EncoderKey(digest, fp, self.spec.modality))
        if pin is None:
            return False
        with self._lock:
            self._pins.setdefault(request_id, []).append(pin)
        return True

    def pinned(self, request_id: str) -> int:
        """How many store entries ``request_id`` holds pinned now."""
        with self._lock:
            return len(self._pins.get(request_id, ()))

    # -- the lookup ---------------------------------------------------------------------------------------------------
    def _resolve(self, graph_walk, engine_inputs, prepared: list[_Prepared]) -> list:
        """Every item's value, in order, through the store's single flight: one query per distinct key, one
        sub-batch for the keys this call leads, a wait for keys another caller leads; each use pinned for its
        request."""
        work = [(p, item) for p in prepared for item in p.items]
        keys = [key for p in prepared for key in p.keys]

        def compute_missing(indices: list[int]) -> list:
            outputs = self._run_node(graph_walk, engine_inputs, [work[i] for i in indices])
            with self._lock:
                self.counters.forward_calls += 1
                self.counters.forward_items += len(indices)
            return [work[i][1].select(out) for i, out in zip(indices, outputs)]

        found = self.store.get_or_compute_many(keys, compute_missing, pin=True)
        counts, seen = {"store": 0, "computed": 0, "joined": 0}, set()
        for key, got in zip(keys, found):
            ident = (key.name, key.verify_ids)
            source = "store" if got.source in ("host", "shared") else got.source  # a tier hit is a hit too
            counts[source if ident not in seen else "joined"] += 1
            seen.add(ident)
        with self._lock:
            c = self.counters
            c.hits, c.misses, c.joins = c.hits + counts["store"], c.misses + counts["computed"], \
                c.joins + counts["joined"]
            for (p, _), got in zip(work, found):
                if got.pin is not None:
                    self._pins.setdefault(p.rid, []).append(got.pin)
        return [got.value for got in found]

    def _run_node(self, graph_walk, engine_inputs, work: list[tuple[_Prepared, Item]]) -> list[dict]:
        """The node's outputs for each item's inputs, dispatched as the engine dispatches a batch: through
        ``forward_batched`` when the node can batch it, else one ``forward`` per item. A request's first item
        runs under its own id and state; a further item of it under ``<rid>#<n>`` with the same state."""
        ids, used = [], set()
        for n, (p, _) in enumerate(work):
            ids.append(p.rid if p.rid not in used else f"{p.rid}#{n}")
            used.add(p.rid)
        infos = {i: p.fwd_info for i, (p, _) in zip(ids, work)}
        states = {i: self.node.request_state(p.rid) for i, (p, _) in zip(ids, work)}
        inputs = [item.inputs for _, item in work]
        sub = ExecutingBatch(node_name="", per_request_info=infos,
                             step_context=StepContext(request_ids=tuple(ids), graph_walk=graph_walk, slot=0,
                                                      capture=False))

        def engine_view(rids):
            return ModelInputsFromEngine(request_ids=list(rids), per_request_info={i: infos[i] for i in rids},
                                         resources=engine_inputs.resources,
                                         piecewise_runners=engine_inputs.piecewise_runners,
                                         per_request_states={i: states[i] for i in rids})

        if self.node.can_batch(batch=sub, model_inputs=inputs):
            ei = engine_view(ids)
            pre = self.node.preprocess(graph_walk, engine_inputs=ei, inputs=inputs)
            out = self.node.forward_batched(graph_walk, engine_inputs=ei, **pre)
            return [out[i] for i in ids]
        outs = []
        for i, inp in zip(ids, inputs):
            ei = engine_view([i])
            pre = self.node.preprocess(graph_walk, engine_inputs=ei, inputs=[inp])
            outs.append(self.node.forward(graph_walk, engine_inputs=ei, **pre))
        return outs


def cache_encoder_nodes(submodules: dict, items: dict[str, NodeItems], store: EncoderStore | None = None,
                        **kwargs) -> dict:
    """``submodules`` (node name -> submodule, as given to M*'s ``Engine.load_model``) with the nodes named in
    ``items`` wrapped in ``CachedEncoderNode``; ``store``: one shared by all of them (default: one per node)."""
    unknown = set(items) - set(submodules)
    if unknown:
        raise InvalidRequest(f"no submodule named {sorted(unknown)} among {sorted(submodules)}")
    return {name: CachedEncoderNode(mod, items[name], store, **kwargs) if name in items else mod
            for name, mod in submodules.items()}
