"""What names, cuts and positions the walks of M*'s BAGEL LLM node (``mstar.model.bagel``, mstar-ai 0.2.1) for prefix
reuse.

A request is a schedule of prefill walks in prompt order (``BagelModel._build_prefill_schedule``), then ``decode``
(understanding) or the flow-matching walk ``image_gen`` (generation, editing). What each walk feeds
(``LLMSubmodule.prepare_inputs``, submodules.py:797-873) and how it attends and moves positions (``declare_step``,
875-1000):

- ``prefill_text``, ``decode``: ``input_ids`` alone, causal, one position a row planned by M*'s ``RopeManager`` from
  the counter: named by their ids, as the seam names any walk of ids;
- ``prefill_vit``: ``<|vision_start|>``, the ViT encoder's rows, ``<|vision_end|>`` as embeddings (``img_emb``
  wrapped, ``_wrap_with_boi_eoi``), through the understanding experts (``mode="und"``); ``prefill_vae``: the same
  around the VAE encoder's rows, which go through the generation experts (``mode="gen"``: the MoT's other q/k/v,
  norms, MLP and o_proj weights, chosen row by row by ``text_mask``). Both attend bidirectionally
  (``AttentionStep(causal=False)``) and put every row at one position, the counter at the walk's start
  (``_get_image_pos_ids``, computed in ``prepare_inputs`` as ``custom_pos_ids``), and declare an advance of 1.

An image walk is one media item at its first row (``image_walk_media``), as Pi0.5's bidirectional prefill is
(``mmcache.mstar.pi05``): its rows' KV depends on every row of the walk, later ones included, so the mark enters the
name of the page of the walk's first row and, through the chain, of every later page: a page holding any of its rows
matches only behind the same whole walk. The digest commits to the walk's kind (the ViT and VAE walks run through
different experts), its row count and dtype, and either the rows fed (``rows_digest`` of ``input_embeds``: the image
as sent, the preprocessing, the encoder's weights) or, for a ViT walk only, the ``image_digest`` the data worker
carried (``mmcache.mstar.media_digests``) when it reaches the LLM node among the walk's inputs (the request's image
digests joined: more than this walk's image, never less), with the step's ``image_preprocess`` (which picks the ViT
node's resize). A VAE walk is always named by its rows: BAGEL's VAE encode
samples its latent (``DiagonalGaussian(sample=True)``, ``torch.randn_like``, unseeded), so the same image gives other
rows at every request, and an image's digest does not say what they are. M* 0.2.1 routes the image to the encoder
nodes only (the LLM's walk inputs are ``img_emb``), so without a routing change the rows' digest names every image.

A cut inside an image walk is exact: the held rows' KV was computed with the same whole walk behind the same prefix
(the names say so), and each row still fed attends to the same keys a cold prefill's row attends to (the held rows
through their pages). ``cut_image_walk`` drops the held rows from the embeddings, the positions of every label and,
for a VAE walk, from the expert mask (``text_mask``; the index lists are rebuilt from it).

Positions (``bagel_position_advance``): after a hit on an image walk the counter stays where the walk started (its
rows' positions are computed already) and the walk's declared advance of 1 moves it as a cold prefill does; a hit on
a text walk moves it, before the step, to the counter at the walk's start plus the held rows (``PrefixReuse.
position_advance`` returning None): a text walk after an image starts at the image's position + 1, not at the token
count, so the default (the token count) would be wrong there.

Labels. Understanding requests write ``main`` only: it is reused. With classifier-free guidance (image generation,
``requires_cfg``) ``prefill_text`` and ``decode`` also write ``cfg_img`` (text only, no images) from the same rows, and
``main`` is forked onto ``cfg_text`` (before a text walk, after an image walk's commit; M*'s fork copies the pages'
bytes onto the target's own pages). The guidance branches are not named (their streams are other sequences than
``main``: ``cfg_img`` skips the images); a guided text walk is therefore computed in full (``writes_guidance_branch``,
``PrefixReuse.needs_every_row``: cutting it would leave ``cfg_img`` without the held rows) and indexed, and a guided
image walk, which writes ``main`` alone, is cut like any other. ``image_gen``/``image_gen_cfg`` commit nothing
(``KVStep(commit=False)``): they write no prompt KV to name.
"""

from __future__ import annotations

import json

import torch

from digests.digest import compute
from mmcache.mstar.encoder_items import carried_digest, rows_digest
from mmcache.mstar.kv_resource import PrefixReuse
from mmcache.mstar.switch import cut_to_suffix

TEXT_WALK, VIT_WALK, VAE_WALK = "prefill_text", "prefill_vit", "prefill_vae"
IMAGE_WALKS = (VIT_WALK, VAE_WALK)


def image_walk_media(graph_walk, fwd_info, inputs, node_inputs):
    """``PrefixReuse.walk_media`` for BAGEL's LLM: an image walk is one item at offset 0 (see the module docstring for
    what its digest commits to); any other walk of embeddings (``image_gen``'s latents) is not described (None)."""
    rows = getattr(node_inputs, "input_embeds", None)
    if graph_walk not in IMAGE_WALKS or rows is None:
        return None
    item = carried_digest(inputs or {}, "image") if graph_walk == VIT_WALK else None
    preprocess = None
    if item is None:
        item = rows_digest(rows)
    else:
        preprocess = (getattr(fwd_info, "step_metadata", None) or {}).get("image_preprocess", "default")
    header = json.dumps({"bagel_image_walk": [graph_walk, int(rows.shape[0]), str(rows.dtype), preprocess]}).encode()
    return [(0, bytes(compute(header, [item])))]


def cut_image_walk(node_inputs, rows: int) -> None:
    """``PrefixReuse.cut`` for BAGEL's LLM: drop the first ``rows`` fed rows wherever a walk has them (ids or
    embeddings, each label's positions, a VAE walk's expert mask and the index lists made from it), so what is left
    is what a cold prefill feeds for those rows."""
    cut_to_suffix(node_inputs, rows)
    if isinstance(node_inputs.custom_pos_ids, dict):
        node_inputs.custom_pos_ids = {label: ids[rows:] for label, ids in node_inputs.custom_pos_ids.items()}
    extra = node_inputs.tensor_inputs
    if extra and extra.get("text_mask") is not None:
        mask = extra["text_mask"][rows:]
        extra["text_mask"] = mask
        extra["text_indexes"] = torch.nonzero(mask).reshape(-1)
        extra["vae_token_indexes"] = torch.nonzero(~mask).reshape(-1)


def bagel_position_advance(graph_walk, node_inputs, rows: int) -> int | None:
    """``PrefixReuse.position_advance`` for BAGEL's LLM: 0 for an image walk (the walk's declared advance of 1 covers
    its held rows: they share its one position); None for a text walk (planned from the counter: the seam moves the
    counter past the held rows before the step)."""
    return 0 if graph_walk in IMAGE_WALKS else None


def writes_guidance_branch(graph_walk, fwd_info) -> bool:
    """``PrefixReuse.needs_every_row`` for BAGEL's LLM: a guided (``requires_cfg``) text walk writes ``cfg_img`` from
    the same rows as ``main``, and ``cfg_img`` does not hold what ``main``'s hit holds."""
    metadata = getattr(fwd_info, "step_metadata", None) or {}
    return graph_walk == TEXT_WALK and bool(metadata.get("requires_cfg", False))


def bagel_reuse(model: str, **options) -> PrefixReuse:
    """``PrefixReuse`` for BAGEL's LLM node (``enable_reuse(m, bagel_reuse(...), nodes={"LLM": "main"},
    kv_keys={"kv"})``): text walks by their ids, image walks by their digests, cut with their positions and expert
    masks, the counter moved as a cold prefill moves it, guided text walks computed in full. ``model``: the checkpoint
    (repository@revision), which holds the ViT's, the VAE's and both experts' weights."""
    return PrefixReuse(model=model, walk_media=image_walk_media, cut=cut_image_walk,
                       position_advance=bagel_position_advance, needs_every_row=writes_guidance_branch, **options)
