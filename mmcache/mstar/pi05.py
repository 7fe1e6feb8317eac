"""What names the prefill of M*'s Pi0.5 LLM node (``mstar.model.pi05``, mstar-ai 0.2.1) for prefix reuse.

A request is ``prefill`` then ``action_gen``. The prefill feeds ``input_embeds`` only, built in the node's
``prepare_inputs`` (submodules.py:456-484): the SigLIP features of the camera images (``img_emb``, the
``vit_encoder`` node's output) times sqrt(hidden), then the text ids embedded times hidden; the text is the task
and the robot state as decimals (``Pi05Model.process_prompt``). ``action_gen`` attends to that KV read-only and
commits nothing (``KVStep(commit=False)``, submodules.py:543): it adds no position to name.

The prefill's attention is bidirectional (``AttentionStep(causal=False)``, submodules.py:544): every position's KV
depends on every row of the prefix, later ones included. A page is therefore reusable only behind exactly the same
whole prefix, so ``prefill_walk_media`` names the walk as one item at offset 0 whose digest is ``rows_digest`` of all
its rows: page 0's name commits to the whole prefix and every later page chains from it. Naming rows one by one, or
text by its ids, would let a request with the same images and another instruction match the image pages, whose KV
attended to the other instruction: a wrong hit. When the data worker's ``image_digest`` (``mmcache.mstar.
media_digests``: the bytes as sent and the preprocessing) reaches the LLM node among the walk's inputs, the item's
digest is that and the text ids, in order, with the rows' count and dtype; the weights (SigLIP's too) are in
``PrefixReuse.model``. M* 0.2.1's graph routes the camera images to ``vit_encoder`` only (the LLM's inputs are
``img_emb`` and ``text_inputs``), so without a routing change the rows' digest names the walk (hashing every row;
on a GPU, one copy of them to the host).

What it is worth: a request with the same images, task and state as an earlier one reuses every full page of the
prefix but the page of its last rows (a step keeps two rows to compute), which is all of the expensive part (the
SigLIP features are 256 rows a camera). Live camera frames and robot state change at every control step, so a
control loop repeats a prefix only when it asks again for the same observation: several action chunks for one
observation (another noise seed, ``fwd_info.random_seed``), a retry, a replayed episode. The positions advance by
the token count (plain RoPE through ``RopeManager``): no ``position_advance``.
"""

from __future__ import annotations

import json

import torch

from digests.digest import compute
from mmcache.mstar.encoder_items import carried_digest, rows_digest
from mmcache.mstar.kv_resource import PrefixReuse

PREFILL_WALK = "prefill"


def prefill_walk_media(graph_walk, fwd_info, inputs, node_inputs):
    """``PrefixReuse.walk_media`` for Pi0.5's LLM: the prefill is one item at offset 0, named by the carried image
    digests and the text ids when the walk's inputs hold an ``image_digest``, else by the digest of all its rows;
    ``action_gen`` feeds no rows to name (None)."""
    rows = getattr(node_inputs, "input_embeds", None)
    if graph_walk != PREFILL_WALK or rows is None:
        return None
    images = carried_digest(inputs or {}, "image")
    if images is None:
        return [(0, rows_digest(rows))]
    text = torch.as_tensor(inputs["text_inputs"][0]).to(torch.int64).contiguous().cpu().numpy().tobytes()
    header = json.dumps({"pi05_prefill": [int(rows.shape[0]), str(rows.dtype), len(images), len(text)]}).encode()
    return [(0, bytes(compute(header, [images, text])))]


def pi05_reuse(model: str, **options) -> PrefixReuse:
    """``PrefixReuse`` for Pi0.5's LLM node (``enable_reuse(m, pi05_reuse(...), nodes={"LLM": "main"},
    kv_keys={"kv"})``): its prefill named as a whole. ``model``: the checkpoint (repository@revision), SigLIP's
    weights included."""
    return PrefixReuse(model=model, walk_media=prefill_walk_media, **options)
