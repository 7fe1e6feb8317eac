"""mmcache inside M* (``mstar-ai`` 0.2.1 from the package index; ``mmcache.mstar.requirement`` says how to install it):
``enable_reuse`` (``switch``) turns it on for a model; prefix KV reuse in M*'s KV resource (``kv_resource``:
``ReuseKVManager`` from a ``ReuseKVSpec``, configured by ``PrefixReuse``, over the state machine of ``reuse_state``),
cached encoder nodes (``encoder_node``, keyed by ``encoder_items``, with digests taken in the data worker by
``media_digests``, tenant salts routed by ``salts`` and counters exported by ``encoder_metrics``), what names the
walks of Higgs Audio (``higgs``), Qwen3-TTS (``qwen3_tts``), Pi0.5 (``pi05``), Qwen3-Omni's thinker (``qwen3_omni``)
and BAGEL's LLM (``bagel``), and replica affinity in M*'s conductor (``conductor``). The names below import M* on
first access, after checking its version; the core (``mmcache``) never imports this package.
"""

import importlib

from mmcache.mstar.requirement import require_mstar

_EXPORTS = {"AffinityConductor": "conductor", "CachedEncoderNode": "encoder_node",
            "cache_encoder_nodes": "encoder_node", "install_digests": "media_digests",
            "route_digests": "media_digests", "store_oracle": "decode_skip", "EncoderNodeCollector": "encoder_metrics",
            "route_salt": "salts", "items_for": "encoder_items", "enable_encoder_reuse": "encoder_reuse",
            "enable_reuse": "switch", "PrefixReuse": "kv_resource", "ReuseKVSpec": "kv_resource",
            "ReuseKVManager": "kv_resource", "higgs_reuse": "higgs", "qwen3_tts_reuse": "qwen3_tts",
            "pi05_reuse": "pi05", "qwen3_omni_reuse": "qwen3_omni", "bagel_reuse": "bagel"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    require_mstar()
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
