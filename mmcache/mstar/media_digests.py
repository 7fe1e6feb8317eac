"""Media digests taken where the bytes are: in M*'s data worker, carried to the encoder node as a graph input.

M*'s data worker (``mstar/api_server/data_worker.py: DataWorker._process_input``) is the only place that sees a
request's raw files; it decodes them (``model.load_image``/``load_audio``) and lets the model preprocess them
(``model.process_prompt``). ``install_digests(worker, params)`` wraps that one worker instance from outside: each
file of the request is digested (its bytes plus the canonical parameters of the processor that turns it into node
inputs, ``digests.image``/``digests.audio``) and the digests join the request's tensors as ``<modality>_digest``
(one uint8 [16] tensor per file, in file order), next to ``pixel_values`` and ``audio_features``.

From there a digest reaches the node like any other tensor: as a graph input of the encoder's walk. For Qwen3-Omni
``route_digests(model)`` adds ``<modality>_digest`` to each encoder step of the thinker's prefill schedule, so
``VisionEncoderSubmodule``/``AudioEncoderSubmodule`` receive ``image_digest``/``audio_digest`` among their inputs;
``WholeRequest`` keys by it (``mmcache.mstar.encoder_items.carried_digest``).
"""

from __future__ import annotations

import functools
import threading

import torch

import digests
from mmcache.errors import InvalidRequest

_MEDIA = {"image": digests.image, "audio": digests.audio, "video": digests.video}


def digest_files(file_paths: dict[str, list], params: dict[str, object]) -> dict[str, list[digests.Digest]]:
    """Per modality, the digest of each file (its bytes, streamed, plus ``params[modality]``: the processor or its
    settings, canonicalised). Modalities without a digest function (text) are left out."""
    return {m: [_MEDIA[m](path, params.get(m)) for path in paths] for m, paths in file_paths.items() if m in _MEDIA}


def digest_tensors(found: dict[str, list[digests.Digest]]) -> dict[str, list[torch.Tensor]]:
    """``{<modality>_digest: [uint8 tensor per file]}``: the form a digest travels in between M*'s workers. Only the
    first 16 bytes travel (all of xxh3-128; a 128-bit prefix of the cryptographic options)."""
    return {f"{m}_digest": [torch.frombuffer(bytearray(bytes(d)[:16]), dtype=torch.uint8) for d in ds]
            for m, ds in found.items() if ds}


def install_digests(worker, params: dict[str, object]) -> None:
    """Make ``worker`` (an M* ``DataWorker``) add ``<modality>_digest`` tensors to every request it preprocesses.

    Wraps the instance's ``_process_input`` (digest the request's files) and its model's ``process_prompt`` (merge
    the digests into the tensors it returns); the class and M*'s files are untouched. Idempotent.
    """
    if getattr(worker, "_mmcache_digests", False):
        return
    unknown = set(params) - set(_MEDIA)
    if unknown:
        raise InvalidRequest(f"no media digest for modalities {sorted(unknown)}; known: {sorted(_MEDIA)}")
    pending = threading.local()
    process_input, process_prompt = worker._process_input, worker.model.process_prompt

    @functools.wraps(process_input)
    def _process_input(input):
        pending.tensors = digest_tensors(digest_files(input.file_paths or {}, params))
        try:
            return process_input(input)
        finally:
            pending.tensors = None

    @functools.wraps(process_prompt)
    def _process_prompt(*args, **kwargs):
        out = process_prompt(*args, **kwargs) or {}
        return {**out, **(getattr(pending, "tensors", None) or {})}

    worker._process_input, worker.model.process_prompt = _process_input, _process_prompt
    worker._mmcache_digests = True


def route_digests(model) -> None:
    """Make a Qwen3-Omni model instance route ``<modality>_digest`` to its encoder nodes: each image/video step of
    the thinker's prefill schedule gets the matching ``image_digest``, each audio step its ``audio_digest`` (the
    schedule's entries become the encoder's input edges). Idempotent; the class is untouched."""
    if getattr(model, "_mmcache_routes_digests", False):
        return
    build = model._build_thinker_prefill_schedule

    @functools.wraps(build)
    def _build(input_modalities, input_signals):
        schedule = build(input_modalities, input_signals)
        taken = {"image": 0, "audio": 0}
        videos = input_signals.get("pixel_values_videos", [])
        for walk, entry in schedule:
            mod = {"prefill_vision": "image", "prefill_audio": "audio"}.get(walk)
            if mod is None or any(entry.get("pixel_values") is v for v in videos):
                continue
            found = input_signals.get(f"{mod}_digest", [])
            if taken[mod] < len(found):
                entry[f"{mod}_digest"] = found[taken[mod]]
            taken[mod] += 1
        return schedule

    model._build_thinker_prefill_schedule = _build
    model._mmcache_routes_digests = True
