"""What names and cuts the walks of M*'s Qwen3-Omni thinker (``mstar.model.qwen3_omni``, mstar-ai 0.2.1) for prefix
reuse.

A thinker request is a schedule of single-modality prefill walks in prompt order (``Qwen3OmniModel.
_build_thinker_prefill_schedule``), then ``thinker_decode``. What each walk feeds (``ThinkerSubmodule.prepare_inputs``,
submodules.py:376-538):

- ``prefill_text``: ``input_ids`` and ``input_embeds = embed_tokens(input_ids)``: an id walk
  (``PrefixReuse.id_walks``), named by its ids;
- ``thinker_decode``: ``input_embeds = embed_tokens(token)`` of the sampled token it reads from its graph input
  ``text_inputs``, without ``input_ids``, at the counter's position on all three axes (a text row): an id walk too,
  its id read from that input (``decode_ids``, ``PrefixReuse.walk_ids``), so generated tokens are indexed as their
  pages fill and a next turn re-sending them as text reuses them;
- ``prefill_audio``: ``<|audio_bos|>``, the audio encoder's rows, ``<|audio_eos|>`` as embeddings, no ids: one media
  item at the walk's first row;
- ``prefill_vision``: ``<|vision_bos|>``, the vision encoder's rows, ``<|vision_eos|>``, plus the encoder's deepstack
  features (added to the hidden states of the first layers, row by row) and the image grid: one media item at the
  walk's first row.

The item's digest (``thinker_walk_media``) is the one the data worker carried (``<modality>_digest``,
``mmcache.mstar.media_digests``) when it reaches the thinker node, else a digest of what the node is fed for the item
(its embedding rows, and for vision its deepstack rows); a vision item's digest also commits to its grid
(``image_grid_thw``, ``video_second_per_grid``), which sets its positions. M* 0.2.1 routes a carried digest to the
encoder nodes only (the thinker's walk inputs are the encoder's outputs), so the rows' digest is what names a walk
unless a routing change carries it further.

Positions (MRoPE, ``components/rope.py``). ``prepare_inputs`` reads the stream's position counter at the walk's start
(submodules.py:384) and computes every fed row's 3D position itself (``custom_pos_ids``): text and audio rows advance
one position per row; a vision item's rows sit on its grid and the walk declares the whole item's advance
(``mrope_pos_advance``, submodules.py:522 and 559), which is not its row count. Attention is causal in every walk
(``AttentionStep(causal=True)``), so the KV of a row depends on the rows before it and their positions only: a cut
anywhere, inside a media item too, is exact when the cut keeps the positions the walk computed for the rows it still
feeds (``cut_thinker_inputs`` slices them) and the counter ends where a cold prefill ends it
(``thinker_position_advance``: the held rows of a text or audio walk advance it one each, at the commit; a vision
walk's declared advance covers its held rows already). Equal names mean equal positions: a walk's start position is
a function of the walks before it (ids, audio lengths, grids), all of which the names commit to.

The talker and code2wav nodes are fed hidden states, not prompts: nothing of theirs is reused. When audio output is
asked, each thinker prefill walk streams every fed row's states to the talker: ``thinker_states`` = (the row's input
embedding, its hidden state after layer ``accept_hidden_layer``), 2 x hidden wide, with ``thinker_mask`` = the walk's
``masks_for_talker`` (which rows are media, which text the talker keeps), selected and filtered by the node's own
``postprocess``. The KV does not hold those states, so they are kept per KV page (``thinker_row_outputs``,
``PrefixReuse.row_outputs``): a forward hook that only reads records every thinker forward's two blocks (eager
``forward`` and ``forward_batched`` alike; audio output asked or not, so a text-only request's pages serve a spoken
one later), the commit stores them by the KV's page ids, and a cut walk's talker outputs get the held rows' states in
front and the walk's whole mask, taken before the cut (the mask of a text row depends on ids after it: the talker
skips a system or assistant turn only once the next ``<|im_start|>`` shows where it ends). Under CUDA graphs a
replayed step runs no hook: its rows are not stored, so its pages serve text-only requests only.
"""

from __future__ import annotations

import json

import torch

from digests.digest import compute
from mmcache.mstar.encoder_items import carried_digest, rows_digest
from mmcache.mstar.kv_resource import PrefixReuse
from mmcache.mstar.row_outputs import RowOutputs
from mmcache.mstar.switch import cut_to_suffix

TEXT_WALK, AUDIO_WALK, VISION_WALK, DECODE_WALK = "prefill_text", "prefill_audio", "prefill_vision", "thinker_decode"


def vision_digest(item: bytes, grid_thw, seconds_per_grid) -> bytes:
    """16 bytes naming a vision item with what sets its positions: the item's digest, its grid (T, H, W per image)
    and the seconds per temporal grid step (video; None for an image)."""
    grid = [] if grid_thw is None else torch.as_tensor(grid_thw).reshape(-1).tolist()
    seconds = None if seconds_per_grid is None else float(torch.as_tensor(seconds_per_grid).reshape(-1)[0])
    header = json.dumps({"vision_item": [grid, seconds]}).encode()
    return bytes(compute(header, [item]))


def _first(inputs, name):
    found = (inputs or {}).get(name)
    return found[0] if found else None


def walk_modality(graph_walk, inputs) -> str | None:
    """The modality of a media walk: ``audio``; ``video`` for a vision walk given seconds per grid step (M* sends
    ``video_second_per_grid`` only with a video, qwen3_omni_model.py:793-797), else ``image``; None for any other
    walk."""
    if graph_walk == AUDIO_WALK:
        return "audio"
    if graph_walk == VISION_WALK:
        return "video" if _first(inputs, "video_second_per_grid") is not None else "image"
    return None


def thinker_walk_media(graph_walk, fwd_info, inputs, node_inputs):
    """``PrefixReuse.walk_media`` for the thinker: a media walk is one item at offset 0, named by the carried digest
    of its own modality (``walk_modality``: a video walk is never named by an image's digest) if the walk's inputs
    hold one, else by its fed rows (embeddings; for vision also the deepstack rows); a vision item's name commits to
    its grid too. Any other walk is not described (None; text and decode are id walks)."""
    modality = walk_modality(graph_walk, inputs)
    if modality is None or getattr(node_inputs, "input_embeds", None) is None:
        return None
    digest = carried_digest(inputs or {}, modality)
    if digest is None:
        deepstack = (node_inputs.tensor_inputs or {}).get("deepstack") or []
        digest = rows_digest(torch.cat([node_inputs.input_embeds, *deepstack]))
    if graph_walk == VISION_WALK:
        digest = vision_digest(digest, _first(inputs, "image_grid_thw"), _first(inputs, "video_second_per_grid"))
    return [(0, digest)]


def cut_thinker_inputs(node_inputs, rows: int) -> None:
    """``PrefixReuse.cut`` for the thinker: drop the first ``rows`` fed rows everywhere they are (ids, embeddings,
    their 3D positions, the talker masks, the deepstack rows), so what is left is exactly what a cold prefill feeds
    for those rows. The walk's declared advance (``mrope_pos_advance``) stays the whole item's."""
    cut_to_suffix(node_inputs, rows)
    if node_inputs.custom_pos_ids is not None:
        node_inputs.custom_pos_ids = node_inputs.custom_pos_ids[:, rows:]
    extra = node_inputs.tensor_inputs or {}
    if extra.get("masks_for_talker") is not None:
        extra["masks_for_talker"] = extra["masks_for_talker"][:, rows:]
    if extra.get("deepstack"):
        extra["deepstack"] = [layer[rows:] for layer in extra["deepstack"]]


def thinker_position_advance(graph_walk, node_inputs, rows: int) -> int:
    """``PrefixReuse.position_advance`` for the thinker: how far the counter moves past ``rows`` held rows of a walk
    (the commit adds it to the walk's declared advance). Text and audio rows take one position each; a vision walk
    declares the whole item's advance from its start (``mrope_pos_advance``), held rows included: 0."""
    return 0 if graph_walk == VISION_WALK else rows


def decode_ids(graph_walk, inputs):
    """``PrefixReuse.walk_ids`` for the thinker: the token ``thinker_decode`` embeds (its ``text_inputs``); None for
    any other walk."""
    token = _first(inputs, "text_inputs") if graph_walk == DECODE_WALK else None
    return None if token is None else token.reshape(-1)


def streams_rows_to_talker(graph_walk, fwd_info) -> bool:
    """``RowOutputs.needed`` for the thinker (``PrefixReuse.needs_every_row`` without row outputs): a prefill walk of a
    request that asks for audio output
    (``step_metadata["audio_output"]``, True unless the conductor says otherwise, as ``ThinkerSubmodule.forward``
    reads it) sends every row's states to the talker. (A decode walk feeds one row, which is never cut.)"""
    metadata = getattr(fwd_info, "step_metadata", None) or {}
    return graph_walk != DECODE_WALK and bool(metadata.get("audio_output", True))


def watch_thinker_states(submodule, record) -> None:
    """``RowOutputs.watch`` for the thinker: a forward hook on its ``Qwen3OmniThinkerModel`` (which returns final
    hidden, layer-0 embeddings, layer-N hidden) hands ``record`` the two blocks ``thinker_states`` concatenates, layer
    N standing in for itself where it is None as M*'s forward does; nothing while a CUDA graph is being captured
    (those rows are dummies)."""
    def hook(module, args, out):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        _, layer_0, layer_n = out
        record((layer_0, layer_0 if layer_n is None else layer_n))

    submodule.model.register_forward_hook(hook)


def talker_masks(node_inputs):
    """``RowOutputs.keep`` for the thinker: the walk's ``masks_for_talker`` (2 x rows) before the cut."""
    return (node_inputs.tensor_inputs or {}).get("masks_for_talker")


def restore_thinker_states(outputs: dict, held_rows: torch.Tensor, masks) -> None:
    """``RowOutputs.restore`` for the thinker: the held rows' states in front of ``thinker_states`` and the walk's
    whole ``masks`` as ``thinker_mask``, in one request's raw outputs (before ``ThinkerSubmodule.postprocess``
    selects and filters them); nothing where the forward emitted no states."""
    states = outputs.get("thinker_states")
    if not states:
        return
    emitted = states[0]
    outputs["thinker_states"] = [torch.cat((held_rows.to(device=emitted.device, dtype=emitted.dtype), emitted))]
    if masks is not None:
        outputs["thinker_mask"] = [masks]


def thinker_row_outputs(hidden_size: int, dtype: torch.dtype = torch.bfloat16) -> RowOutputs:
    """``PrefixReuse.row_outputs`` for the thinker: ``thinker_states`` rows, 2 x ``hidden_size`` (M*'s
    ``Qwen3OmniModelConfig.thinker_hidden_size``) of ``dtype`` (the thinker's: bf16 as M* serves it)."""
    return RowOutputs(width=2 * int(hidden_size), dtype=dtype, watch=watch_thinker_states,
                      needed=streams_rows_to_talker, keep=talker_masks, restore=restore_thinker_states)


def qwen3_omni_reuse(model: str, hidden_size: int | None = None, dtype: torch.dtype = torch.bfloat16,
                     **options) -> PrefixReuse:
    """``PrefixReuse`` for Qwen3-Omni's thinker node (``enable_reuse(..., nodes={"Thinker": "main"},
    kv_keys={THINKER_KV})``): its text and decode walks named by their ids, its audio and vision walks by their media
    digests, cut with their positions, the MRoPE counter moved as a cold prefill moves it. ``model``: the Qwen3-Omni
    checkpoint (repository@revision), which holds the encoders' weights too. With ``hidden_size`` (the thinker's,
    ``config.thinker_hidden_size``) the states of the rows a cut walk holds are handed to the talker from the pages
    beside the KV (``thinker_row_outputs``, ``dtype``), so requests asking for audio output are cut too; that takes
    no ``tiers`` (a page copied up carries no states: ``InvalidRequest`` when the KV resource is built). Without it
    their walks are computed in full (``streams_rows_to_talker``), named and indexed for text-only requests, and
    ``tiers`` may be given."""
    if hidden_size is None:
        extra = dict(needs_every_row=streams_rows_to_talker)
    else:
        extra = dict(row_outputs=thinker_row_outputs(hidden_size, dtype))
    return PrefixReuse(model=model, id_walks=(TEXT_WALK, DECODE_WALK), walk_ids=decode_ids,
                       walk_media=thinker_walk_media, cut=cut_thinker_inputs,
                       position_advance=thinker_position_advance, **extra, **options)
