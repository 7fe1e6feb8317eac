"""The one call that turns reuse on for an M* model: ``enable_reuse(model, PrefixReuse(...), nodes=...)``: prefix KV
reuse for its KV specs and, unless ``encoders=False``, encoder-output reuse for its encoder nodes
(``mmcache.mstar.encoder_reuse.enable_encoder_reuse``).

From outside M*, on the model object the engine loads (no M* file changes):

- ``get_node_resources``: each ``KVSpec`` named in ``kv_keys`` becomes a ``ReuseKVSpec``, so the engine
  builds a ``ReuseKVManager`` for it through its own ``build_resource``;
- ``get_submodule``: each node in ``nodes`` (node name -> the label its step writes its prompt into) gets the seam (a
  ``NodeSeam``, one ``RequestRecord`` per request) on its ``prepare_inputs`` and ``declare_step``. ``prepare_inputs``
  is where M* hands a node its ids and its resources before a step is declared: the seam asks the KV resource what the
  stream holds (``ReuseKVManager.feed``, which matches the first feed), moves the node's position counter past a hit
  as a cold prefill would (through the position resource's own ``admit_retrieve``, the way M* takes on published
  positions; or, for a node that computes its positions in ``prepare_inputs``, ``PrefixReuse.position_advance``,
  through the step's declared advance, or, for a walk of such a node whose positions the position resource plans, from
  the counter at the walk's start), and cuts what the step feeds (``input_ids``, ``input_embeds``, each once, or what
  ``PrefixReuse.cut`` cuts) to the suffix. A step whose outputs carry every fed row (``RowOutputs.needed``,
  ``PrefixReuse.row_outputs``) is cut only at pages whose row outputs are held; the seam reads the cut rows' outputs
  then, keeps what ``RowOutputs.keep`` takes from the uncut inputs, and ``postprocess`` puts both back in front of
  what the forward emitted (``RowOutputs.restore``), so the node's consumer gets every row as without reuse (the seam
  is on ``postprocess`` only while such rows wait); a step that ``PrefixReuse.needs_every_row`` is named and never
  cut. A step fed ids alone is named by them; a step fed embeddings is named by its ids when its walk is one of
  ``PrefixReuse.id_walks`` (embeddings that are the embedding of those ids), else by the media marks
  ``PrefixReuse.walk_media`` gives (once per walk: a walk retried after ``AllocationFailed`` keeps the marks it was
  given), else by nothing, which stops the stream's indexing there. A one-row feed (a decode step's) is never cut, so
  ``prepare_inputs`` only keeps it, and ``declare_step`` hands the step's one-row feeds to the KV resource at once
  (``ReuseKVManager.feed_rows``) before M* admits the step. A walk whose batch was all such feeds of named streams (a
  decode walk) is plain from then on: its batches run the node's own ``prepare_inputs`` (the seam steps aside at the
  batch's first request; ``declare_step`` puts it back) and ``declare_step`` reads the ids from the inputs it is
  handed, so a decode step costs no Python per request in the seam; a batch that breaks the pattern is fed as far as
  it is plain, nothing of it is cut, and the walk goes through the seam again. ``declare_step`` also keeps the
  sampler's repetition penalty over the whole prompt, hit or not, so sampling is what it was, and adds the held rows'
  advance to the step's declared position advance where ``position_advance`` says so. ``cleanup_request`` (M*'s engine
  calls it on every submodule when it removes a request) drops what the seam kept for the request.

The tenant salt comes from the request's ``model_kwargs["mmcache_salt"]``: ``route_salt`` (``mmcache.mstar.salts``, the
one salt reader, shared with the encoder nodes) carries it into every pass's ``step_metadata``, where the seam reads
it. With reuse off (no ``enable_reuse``) M* runs as it ships.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

from mmcache.mstar.encoder_reuse import enable_encoder_reuse
from mmcache.mstar.kv_resource import PrefixReuse, ReuseKVManager, ReuseKVSpec
from mmcache.mstar.requirement import require_mstar
from mmcache.mstar.salts import request_salt, route_salt

require_mstar()
from mstar.engine.resources.kv.config import KVSpec  # noqa: E402
from mstar.engine.resources.position.config import PositionStep  # noqa: E402
from mstar.engine.resources.position.manager import PositionManager, PublishedPositionInfo  # noqa: E402
from mstar.engine.resources.sampler.config import SamplerStep  # noqa: E402


def enable_reuse(model, reuse: PrefixReuse, nodes: Mapping[str, str], kv_keys: set[str], encoders: bool = True):
    """Turn reuse on for ``model`` (an M* ``Model`` instance, before the engine loads it); returns it. ``nodes``:
    node name -> the KV label that node's prefill writes (e.g. ``{"LLM": "main"}``); ``kv_keys``: the KV resources
    whose KV the fed token ids alone determine (never a cross-attention cache, nor a decoder's whose layers attend
    to an encoder's output: Whisper's decoder KV depends on the audio); ``encoders``: also reuse encoder outputs."""
    specs_of, submodule_of = model.get_node_resources, model.get_submodule
    labels = tuple(sorted(set(nodes.values()) | set(reuse.labels)))
    reuse = reuse if labels == reuse.labels else type(reuse)(**{**reuse.__dict__, "labels": labels})

    def get_node_resources():
        return [ReuseKVSpec.of(s, reuse) if type(s) is KVSpec and s.resource_key in kv_keys else s
                for s in specs_of()]

    def get_submodule(node_name, *args, **kwargs):
        submodule = submodule_of(node_name, *args, **kwargs)
        if submodule is not None and node_name in nodes:
            name_what_is_fed(submodule, node_name, nodes[node_name])
        return submodule

    model.get_node_resources, model.get_submodule = get_node_resources, get_submodule
    route_salt(model)
    if encoders:
        enable_encoder_reuse(model)
    return model


def name_what_is_fed(submodule, node_name: str, label: str) -> NodeSeam:
    """Put the seam on one node's submodule (see the module docstring); returns it."""
    seam = NodeSeam(submodule, node_name, label)
    for method in ("prepare_inputs", "declare_step", "cleanup_request"):
        if seam.own[method] is not None:
            seam.enter(method)
    return seam


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """What the seam keeps of one request between its steps through the node, each field cleared once used; the
    record goes whole (``NodeSeam.drop``) when the request's feeds are one row each (a decode step's: nothing of it
    is cut) or the request leaves."""

    full_prompt: torch.Tensor | None = None  # the ids before the cut, for the repetition penalty (taken at declare)
    advance: tuple[str, set, int] | None = None  # (label, position resource keys, advance past held rows)
    # (walk, where the stream stood at its start, position key -> the counter then): for a walk whose positions the
    # position resource plans from the counter, beside ``position_advance``; a retried step finds its start here
    walk_start: tuple[str, int, dict[str, int]] | None = None
    restore: tuple | None = None  # (RowOutputs, the cut rows' outputs, what keep took) for its postprocess
    announced: tuple | None = None  # (KV resource, walk, rows, marks): its last media walk, for a retry


class NodeSeam:
    """The seam on one node's submodule (see the module docstring): one ``RequestRecord`` per request in
    ``requests``, and the node's methods rewired by ``enter`` and ``leave`` only. Invariants: ``restoring`` is the
    number of records holding a ``restore``, and the seam is on the node's ``postprocess`` only while it is not 0 (a
    decode batch's requests go straight to the node's own); the node's ``prepare_inputs`` is the node's own only from
    a plain walk's first request to its ``declare_step``."""

    __slots__ = ("node", "node_name", "label", "own", "mine", "requests", "restoring", "resources", "kvs", "one_row",
                 "one_row_infos", "plain_walks")

    def __init__(self, submodule, node_name: str, label: str):
        self.node, self.node_name, self.label = submodule, node_name, label
        methods = ("prepare_inputs", "declare_step", "postprocess", "cleanup_request")
        self.own = {m: getattr(submodule, m, None) for m in methods}  # the node's own (bound methods)
        self.mine = {m: getattr(self, m) for m in methods}  # bound once: the node's attribute compares by identity
        self.requests: dict[str, RequestRecord] = {}
        self.restoring = 0
        self.resources: tuple = (None, 0)  # the node's resources dict and its size, when ``kvs`` was found
        self.kvs: tuple = ()  # its (key, KV resource) pairs that name ``label``
        self.one_row: dict = {}  # KV resource -> {rid: ids}: the step's one-row feeds, fed when it is declared
        self.one_row_infos: dict = {}  # rid -> its forward pass info (a stream fed alone takes its salt from it)
        # walks whose last batch fed every request one id and nothing else (decode walks): their batches go to the
        # node's own ``prepare_inputs`` (the seam steps aside for the rest of the batch at its first request and
        # ``declare_step`` puts it back) and ``declare_step`` feeds the ids from the inputs it is handed
        self.plain_walks: set = set()

    def enter(self, method: str) -> None:
        """The seam's ``method`` on the node, in place of the node's own."""
        setattr(self.node, method, self.mine[method])

    def leave(self, method: str) -> None:
        """The node's own ``method`` back: the seam steps aside."""
        setattr(self.node, method, self.own[method])

    def drop(self, rid: str) -> None:
        """Forget what the seam keeps of ``rid``: its record, in one pop."""
        record = self.requests.pop(rid, None)
        if record is not None and record.restore is not None:
            self.restoring -= 1

    def kv_resources(self, resources: dict) -> tuple:
        """The (key, KV resource) pairs of ``resources`` that name ``label``; found once per resources dict (the
        engine hands a node the same one every step), not by a type check of every resource at every step."""
        if self.resources[0] is not resources or self.resources[1] != len(resources):
            self.resources = resources, len(resources)
            self.kvs = tuple((k, r) for k, r in resources.items()
                             if isinstance(r, ReuseKVManager) and r.reuses(self.label))
        return self.kvs

    def prepare_inputs(self, *args, **kwargs):
        if self.plain_walks and kwargs.get("graph_walk") in self.plain_walks:
            self.leave("prepare_inputs")  # the batch's other requests skip the seam: nothing to do per request
            return self.own["prepare_inputs"](*args, **kwargs)
        out = self.own["prepare_inputs"](*args, **kwargs)
        resources, fwd_info = kwargs.get("resources"), kwargs.get("fwd_info")
        if out is None or not resources or fwd_info is None or not hasattr(out, "input_ids"):
            return out
        label, requests = self.label, self.requests
        for key, kv in self.kv_resources(resources):
            # ids alone describe the step only when no embeddings go in with them (embeddings may carry anything), or
            # when the model declares the embeddings are those of the ids (``PrefixReuse.id_walks``: Higgs Audio's and
            # Qwen3-Omni's text walks; ids its node inputs lack come from ``walk_ids``); any other step of embeddings
            # is named by its media marks, if the model says
            rid, r, graph_walk = fwd_info.request_id, kv.reuse, kwargs.get("graph_walk")
            ids, marks = out.input_ids, ()
            if getattr(out, "input_embeds", None) is not None:
                if graph_walk not in r.id_walks:
                    marks = self.walk_marks(kv, rid, graph_walk, fwd_info, kwargs.get("inputs"), out) \
                        if r.walk_media else None
                    ids = None
                elif ids is None and r.walk_ids is not None:
                    ids = r.walk_ids(graph_walk, kwargs.get("inputs"))
            if ids is not None and not marks and int(out.input_seq_len) == 1:
                # a decode step's feed: never cut (a prefill is never cut to one row), so it waits for the step
                self.one_row.setdefault(kv, {})[rid] = ids
                self.one_row_infos[rid] = fwd_info
                if requests:  # empty in a decode step
                    self.drop(rid)
                continue
            if self.one_row:  # a one-row feed of an earlier step that was never declared is not this step's
                self.one_row.get(kv, {}).pop(rid, None)
            salt = step_salt(fwd_info)
            rows = r.row_outputs
            needed = rows is not None and rows.needed(graph_walk, fwd_info)
            if rows is not None:
                kv.watch(self.node)
            kept = rows.keep(out) if needed else None  # before the cut
            whole = r.needs_every_row is not None and r.needs_every_row(graph_walk, fwd_info)
            held = kv.feed(rid, label, ids, marks or (), salt, int(out.input_seq_len), rows_needed=needed,
                           whole=whole)
            record = requests.get(rid)
            if marks:
                if record is None:
                    record = requests[rid] = RequestRecord()
                record.announced = kv, graph_walk, int(out.input_seq_len), marks
            elif record is not None:
                record.announced = None
            if record is not None:
                record.advance = None
                if record.restore is not None:
                    record.restore = None
                    self.restoring -= 1
            if held:
                if record is None:
                    record = requests[rid] = RequestRecord()
                self.cut(kv, key, record, rid, graph_walk, resources, out, ids, held, needed, kept)
            elif record is not None:
                record.full_prompt = record.walk_start = None
        return out

    def cut(self, kv, key: str, record: RequestRecord, rid: str, graph_walk: str, resources: dict, out, ids,
            held: int, needed: bool, kept) -> None:
        """Cut ``out`` to what (``rid``, ``label``)'s stream does not hold (its ``held`` leading rows): the held rows'
        outputs kept for its ``postprocess`` where its step's rows are ``needed`` (with ``kept``, what
        ``RowOutputs.keep`` took), its position counter moved past them, its full prompt kept for the sampler."""
        r, label = kv.reuse, self.label
        if needed:
            stored = kv.stored(rid, label)
            record.restore = r.row_outputs, kv.held_rows(rid, label, stored - held, stored), kept
            self.restoring += 1
            if self.own["postprocess"] is not None and self.node.postprocess == self.own["postprocess"]:
                self.enter("postprocess")  # on while held rows wait to be put back
        positions = {k for k, res in resources.items() if isinstance(res, PositionManager) and key in res.depends_on()}
        advance = None if r.position_advance is None else r.position_advance(graph_walk, out, held)
        if advance is not None:  # the commit moves the counter: see ``PrefixReuse``
            record.advance = label, positions, int(advance)
        elif r.position_advance is not None:  # a walk the position resource plans from the counter
            start = kv.stored(rid, label) - held
            if record.walk_start is None or record.walk_start[:2] != (graph_walk, start):  # not a retry of this walk
                record.walk_start = graph_walk, start, {k: resources[k].position(rid, label) for k in positions}
            for k, position in record.walk_start[2].items():
                resources[k].admit_retrieve(rid, self.node_name, graph_walk,
                                            PublishedPositionInfo(counters={label: position + held}))
        else:  # RoPE: the position is the token count
            position = kv.stored(rid, label)
            for k in positions:
                resources[k].admit_retrieve(rid, self.node_name, graph_walk,
                                            PublishedPositionInfo(counters={label: position}))
        if ids is not None:
            record.full_prompt = ids
        (r.cut or cut_to_suffix)(out, held)

    def walk_marks(self, kv, rid: str, graph_walk: str, fwd_info, inputs, out):
        """The media marks of a walk of embeddings (``PrefixReuse.walk_media``), named once per walk: the walk the
        seam announced last for ``rid``, fed again where its stream still stands inside it (``marks_taken``: the
        step refused before it wrote, and fed again by M*'s worker after ``AllocationFailed``), takes the marks it
        was given then, and its rows (which a model without a carried digest hashes whole) are not named again. Those
        marks are read for being there only: the stream's names hold them already."""
        record = self.requests.get(rid)
        last = record.announced if record is not None else None
        if (last is not None and last[0] is kv and last[1:3] == (graph_walk, int(out.input_seq_len))
                and kv.marks_taken(rid, self.label)):
            return last[3]
        return kv.reuse.walk_media(graph_walk, fwd_info, inputs, out)

    def declare_step(self, graph_walk, request_ids, inputs, *args, **kwargs):
        if self.node.prepare_inputs is self.own["prepare_inputs"]:
            self.enter("prepare_inputs")  # the seam stepped aside for a plain walk's batch
        if graph_walk in self.plain_walks:
            self.feed_plain_step(graph_walk, request_ids, inputs)
        elif self.one_row:
            if self.feed_one_row_steps(set(request_ids)) and len(inputs) == len(request_ids) and all(
                    plain_row(inp) for inp in inputs):
                self.plain_walks.add(graph_walk)
        step = self.own["declare_step"](graph_walk, request_ids, inputs, *args, **kwargs)
        if step is not None and self.requests:
            self.hand_over(step)
        return step

    def hand_over(self, step) -> None:
        """Give ``step`` what its cut requests' records keep for it, each taken once: the full prompt to the sampler's
        repetition penalty, the advance past held rows to the position step."""
        requests = self.requests
        if any(record.full_prompt is not None for record in requests.values()):
            for sub in step.steps.values():
                if isinstance(sub, SamplerStep):
                    for rid in list(sub.prefill_tracked_tokens):
                        record = requests.get(rid)
                        if record is not None and record.full_prompt is not None:
                            sub.prefill_tracked_tokens[rid], record.full_prompt = record.full_prompt, None
        advances = {rid: record.advance for rid, record in requests.items() if record.advance is not None}
        if advances:
            add_held_advance(step, advances)
            for rid in {seg.request_id for seg in step.segments or ()} & advances.keys():
                requests[rid].advance = None

    def feed_one_row_steps(self, request_ids) -> bool:
        """Feed the step's one-row feeds (of the requests still in it) through ``ReuseKVManager.feed_rows``; a stream
        it leaves (not named yet, or measured in shadow) is fed alone. Returns whether every request of the step was
        such a feed of a named stream."""
        every = True
        for kv, rows in self.one_row.items():
            for rid in rows.keys() - request_ids:  # prepared, then left the step (failed or declined)
                del rows[rid]
            left = kv.feed_rows(self.label, rows)
            every = every and not left and len(rows) == len(request_ids)
            for rid in left:
                kv.feed(rid, self.label, rows[rid], (), step_salt(self.one_row_infos[rid]), 1)  # one row: no cut
        self.one_row.clear()
        self.one_row_infos.clear()
        return every

    def feed_plain_step(self, graph_walk: str, request_ids, inputs) -> None:
        """A plain walk's step: each request's one id, from the inputs the node made, to ``feed_rows`` at once. A
        stream ``feed_rows`` leaves (not named yet, or in shadow) is not fed: it would be named without the salt its
        forward pass carries, unseen here, so it stays unnamed (computed and written as without reuse, never indexed).
        An input that is not one id (the seam did not see it prepared either) leaves its stream unfed, which stops its
        naming (``ReuseState``: a write no feed named). Either way the walk is plain no more: its next batch goes
        through the seam request by request. Nothing is ever cut here, so what runs is what runs without reuse."""
        if self.requests:  # empty in a decode step
            for rid in request_ids:
                self.drop(rid)
        if self.one_row:  # left by a batch that was never declared
            self.one_row.clear()
            self.one_row_infos.clear()
        ids = [getattr(inp, "input_ids", None) for inp in inputs]
        if len(inputs) == len(request_ids) and plain_rows(inputs, ids):
            rows = dict(zip(request_ids, ids))
        else:
            self.plain_walks.discard(graph_walk)
            rows = {rid: inp.input_ids for rid, inp in zip(request_ids, inputs) if plain_row(inp)}
        for _, kv in self.kvs:
            if kv.feed_rows(self.label, rows):
                self.plain_walks.discard(graph_walk)

    def postprocess(self, *args, **kwargs):
        """Put a cut step's held rows back in front of what its forward emitted; the seam is on the node's
        ``postprocess`` only while some are held (a decode batch's requests go straight to the node's own)."""
        rid = kwargs["request_id"] if "request_id" in kwargs else args[0]
        record = self.requests.get(rid)
        if record is not None and record.restore is not None:
            (rows, held_rows, kept), record.restore = record.restore, None
            self.restoring -= 1
            rows.restore(kwargs["outputs"] if "outputs" in kwargs else args[2], held_rows, kept)
        if not self.restoring and self.node.postprocess is self.mine["postprocess"]:
            self.leave("postprocess")
        return self.own["postprocess"](*args, **kwargs)

    def cleanup_request(self, request_id, *args, **kwargs):
        # what the seam kept for a request it will not see again: one removed before its next step through this
        # node (a hit on its last prefill walk, then done), or whose admit failed (it reaches no postprocess)
        self.drop(request_id)
        return self.own["cleanup_request"](request_id, *args, **kwargs)


def plain_row(node_inputs) -> bool:
    """Whether a step's node inputs are one id and nothing else (a decode step's)."""
    return (getattr(node_inputs, "input_embeds", None) is None and getattr(node_inputs, "input_ids", None) is not None
            and int(node_inputs.input_seq_len) == 1)


def plain_rows(inputs: list, ids: list) -> bool:
    """``plain_row`` of every one of a step's ``inputs`` (``ids``: their ``input_ids``), in a few passes each made by
    one call (a decode batch's)."""
    try:
        return ([inp.input_embeds for inp in inputs].count(None) == len(inputs)  # Nones compare by identity
                and all(i is not None for i in ids)  # (``in`` or ``count`` would compare each tensor with None)
                and {inp.input_seq_len for inp in inputs} == {1})
    except AttributeError:  # inputs of another kind: one by one
        return all(plain_row(inp) for inp in inputs)


def add_held_advance(step, advances: dict[str, tuple[str, set, int]]) -> None:
    """Add each cut request's advance past its held rows (``advances``: rid -> (label, position resource keys,
    advance)) to the advance of its segment of that label in ``step``'s ``PositionStep`` for those keys. A step
    declaring no advance moves the counter by each segment's span (M*'s linear counter, the default scheme), which
    the sum starts from."""
    none = ("", (), 0)
    for key, sub in list(step.steps.items()):
        if not isinstance(sub, PositionStep) or not sub.segments:
            continue
        base = sub.advance if sub.advance is not None else tuple(seg.span for seg in sub.segments)
        extra = [add if seg.label == label and key in keys else 0
                 for seg in sub.segments for label, keys, add in (advances.get(seg.request_id, none),)]
        if any(extra):
            step.steps[key] = dataclasses.replace(sub, advance=tuple(a + e for a, e in zip(base, extra, strict=True)))


def step_salt(fwd_info) -> bytes:
    """The tenant salt the request's forward pass carries in its ``step_metadata`` (``route_salt`` put it there)."""
    metadata = getattr(fwd_info, "step_metadata", None)
    return request_salt(metadata, "step_metadata") if metadata else b""


def cut_to_suffix(node_inputs, held: int) -> None:
    """Drop the first ``held`` rows of what a step feeds, each input once: ``input_ids`` and ``input_embeds``
    (whichever are there; Higgs Audio's text walk feeds both) and ``input_seq_len``."""
    for name in ("input_ids", "input_embeds"):
        rows = getattr(node_inputs, name, None)
        if rows is not None:
            setattr(node_inputs, name, rows[held:])
    node_inputs.input_seq_len = int(node_inputs.input_seq_len) - held
