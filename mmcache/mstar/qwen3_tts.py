"""What names the walks of M*'s Qwen3-TTS Talker (``mstar.model.qwen3_tts``, mstar-ai 0.2.1) for prefix reuse.

A request is ``talker_prefill`` then ``talker_decode``, one row a frame; every walk feeds ``input_embeds`` only. The
prefill's rows are built in the node's ``prepare_inputs`` by ``TalkerSubmodule._build_prefill`` (submodules.py:
203-298): the 3 ChatML role ids projected (fixed; the node refuses any other), the codec tag rows (think or nothink,
think BOS, the language id when one is set, think EOS, the speaker id, codec PAD; each plus the projected TTS PAD,
the last plus TTS BOS), then the first text token projected plus codec BOS: 9 rows with the language on auto, 10
with one. The rest of the text never enters the prefill: one token of it is added to each decode row.

``prefill_rows_media`` names each prefill row by itself: one mark a row, at its offset, whose digest is
``rows_digest`` of that row (dtype, width, bytes). A position's KV depends on the rows up to it, their positions and
the weights: the page chain commits to every earlier row and position and ``PrefixReuse.model`` to the weights, so
equal names mean equal KV (up to a 128-bit collision, which verification cannot catch: there are no ids). A mark a
row, not one for the walk, keeps what two requests share: the same speaker and language share every row before the
first text token; another speaker's rows differ from the speaker row on, so no page holding it or anything after it
matches. The rows' bytes rather than the ids that made them: equal ids give equal rows only while the layout and the
shapes ``_build_prefill`` computes them in stay as in 0.2.1; the bytes are what the KV was computed from, whatever M*
does. It costs hashing the prefill (9-10 rows x hidden_size x 2 bytes) and, on a GPU, one copy of it to the host.

``talker_decode`` rows are named by nothing, so a stream's indexing stops at its first frame: each is one row (the
previous frame's summed codec embeddings plus a text projection) and a later request is matched on its prefill only
(a TTS request re-sends no earlier frames), so naming them would index pages no request can reach.

The RoPE position advance is the token count (``ParallelAttention`` through M*'s ``RopeManager``, plain 1-D RoPE):
no ``position_advance``. What it is worth: at most the prefill's rows before the first text token (8 or 9), in
whole pages, and a step keeps two rows to compute: at page size 4, 2 pages when a language is set, 1 on auto; at 8,
1 and none; at 16 or more, none, and M*'s default page size is 128 (``KVConfig.page_size``, kv/config.py:30; its
qwen3tts.yaml keeps it). Equal text shares no more than equal speaker and language: the text's first token is the
prefill's last row, always computed. The CodePredictor's KV is a frame-local scratch tensor (not a resource),
overwritten every frame: nothing to reuse across requests. The Codec node has no KV.
"""

from __future__ import annotations

from mmcache.mstar.encoder_items import rows_digest
from mmcache.mstar.kv_resource import PrefixReuse

PREFILL_WALK = "talker_prefill"


def prefill_rows_media(graph_walk, fwd_info, inputs, node_inputs):
    """``PrefixReuse.walk_media`` for the Talker: on ``talker_prefill``, a mark ``(i, rows_digest(row i))`` for every
    row fed; any other walk is not described (None)."""
    rows = getattr(node_inputs, "input_embeds", None)
    if graph_walk != PREFILL_WALK or rows is None:
        return None
    rows = rows.detach().cpu()
    return [(i, rows_digest(rows[i])) for i in range(rows.shape[0])]


def qwen3_tts_reuse(model: str, **options) -> PrefixReuse:
    """``PrefixReuse`` for Qwen3-TTS's Talker node (``enable_reuse(m, qwen3_tts_reuse(...), nodes={"Talker": "main"},
    kv_keys={"talker_kv"})``): its prefill named row by row. ``model``: the checkpoint (repository@revision), which
    holds every weight the rows and the KV depend on."""
    return PrefixReuse(model=model, walk_media=prefill_rows_media, **options)
