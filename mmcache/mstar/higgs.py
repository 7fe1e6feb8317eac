"""What names the walks of M*'s Higgs Audio LLM (``mstar.model.higgs_audio``, mstar-ai 0.2.1) for prefix reuse.

A Higgs request is ``prefill_text`` (the ChatML prompt up to ``<|audio_bos|>``), ``prefill_audio`` (the audio
encoder's embeddings), ``prefill_text`` (``<|audio_eos|>`` to the assistant turn), then ``decode``:

- both text walks feed ``input_ids`` and ``input_embeds = embed_tokens(input_ids)`` (the embedding only so they
  share ``prefill_audio``'s packed capture): they are ``TEXT_WALKS``, named by their ids (``PrefixReuse.id_walks``);
- ``prefill_audio`` is one media item at the walk's first row, named by ``audio_walk_media``: the digest the data
  path carried (``audio_digest`` among the walk's inputs, ``mmcache.mstar.media_digests``) when it reaches the LLM
  node, else a digest of the embedding rows the node is fed. The rows' digest commits to everything the walk's KV
  depends on beyond its position (the rows themselves: the audio as sent, the feature extraction, the encoder's
  weights); it costs hashing the rows (hidden_size x 2 bytes per row, 12.5 rows per second of audio) and, on a GPU,
  copying them to the host. A carried digest covers the bytes and the preprocessing parameters it was taken with;
  the encoder's weights are in the Higgs checkpoint that ``PrefixReuse.model`` names.

M* 0.2.1's Higgs graph routes the schedule's ``prefill_audio`` inputs to the ``audio_encoder`` node only (the LLM
node's walk inputs are the encoder's ``audio_embeds``), so without a routing change the rows' digest is what names
the walk.
"""

from __future__ import annotations

from mmcache.mstar.encoder_items import carried_digest, rows_digest
from mmcache.mstar.kv_resource import PrefixReuse

TEXT_WALKS = ("prefill_text",)
AUDIO_WALK = "prefill_audio"


def audio_walk_media(graph_walk, fwd_info, inputs, node_inputs):
    """``PrefixReuse.walk_media`` for Higgs's LLM: ``prefill_audio`` is one media item at offset 0 (the carried
    ``audio_digest`` if the walk's inputs hold one, else the rows' digest); any other walk of embeddings is not
    described (None)."""
    if graph_walk != AUDIO_WALK or getattr(node_inputs, "input_embeds", None) is None:
        return None
    digest = carried_digest(inputs or {}, "audio")
    return [(0, digest if digest is not None else rows_digest(node_inputs.input_embeds))]


def higgs_reuse(model: str, **options) -> PrefixReuse:
    """``PrefixReuse`` for Higgs Audio's LLM node: its text walks named by their ids, its audio walk by its media
    digest. ``model``: the Higgs checkpoint (repository@revision), which holds the encoder's weights too."""
    return PrefixReuse(model=model, id_walks=TEXT_WALKS, walk_media=audio_walk_media, **options)
