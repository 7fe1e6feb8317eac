"""Media digests taken where the bytes are: in M*'s data worker, carried to the encoder node as a graph input.

M*'s data worker (``mstar/api_server/data_worker.py: DataWorker._process_input``) is the only place that sees a
request's raw files; it decodes them (``model.load_image``/``load_audio``) and lets the model preprocess them
(``model.process_prompt``). ``install_digests(worker, params)`` wraps that one worker instance from outside: each
file of the request is read once, decoded from those bytes (``mmcache.mstar.media_bytes``) and digested (its
bytes plus the canonical parameters of the processor that turns it into node inputs, ``digests.image``/
``digests.audio``), with the request's tenant salt folded in (``mmcache.mstar.salts``), and the digests join the
request's tensors as ``<modality>_digest`` (one uint8 [16] tensor per file, in file order), next to ``pixel_values``
and ``audio_features``.

From there a digest reaches the node like any other tensor: as a graph input of the encoder's walk. For Qwen3-Omni
``route_digests(model)`` adds ``<modality>_digest`` to each encoder step of the thinker's prefill schedule, so
``VisionEncoderSubmodule``/``AudioEncoderSubmodule`` receive ``image_digest``/``audio_digest`` among their inputs;
``WholeRequest`` keys by it (``mmcache.mstar.encoder_items.carried_digest``).

The same carried digests also join the request's ``model_kwargs`` as ``ROUTE_MEDIA_KWARG`` (a list of 16-byte
values, file by file, modality by modality as the request lists them), which the data worker hands to the conductor
with the request: ``mmcache.mstar.conductor.AffinityConductor`` with ``key = "media"`` routes by the first of them.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

import torch

import digests
from mmcache.errors import InvalidRequest
from mmcache.mstar.decode_skip import Known, MediaKey, stand_ins_for
from mmcache.mstar.media_bytes import decode_from, read_request_files
from mmcache.mstar.salts import request_salt, salted_digest

_MEDIA = {"image": digests.image, "audio": digests.audio, "video": digests.video}
ROUTE_MEDIA_KWARG = "mmcache_route_media"


def digest_files(file_paths: dict[str, list], params: dict[str, object],
                 blobs: dict[tuple[str, str], bytes] | None = None) -> dict[str, list[digests.Digest]]:
    """Per modality, the digest of each file (its bytes plus ``params[modality]``: the processor or its settings,
    canonicalised); ``blobs`` (``media_bytes.read_request_files``) holds the bytes already read, else each file is
    read here. Modalities without a digest function (text) are left out."""
    blobs = blobs if blobs is not None else read_request_files(file_paths)
    return {m: [_MEDIA[m](blobs[(m, os.fspath(p))], params.get(m)) for p in paths]
            for m, paths in file_paths.items() if m in _MEDIA}


def carried(found: dict[str, list[digests.Digest]], salt: bytes) -> dict[str, list[bytes]]:
    """Per modality, the 16 bytes that travel for each file: its digest with the request's tenant salt folded in
    (``salts.salted_digest``; all of xxh3-128, a 128-bit prefix of the cryptographic options)."""
    return {m: [salted_digest(bytes(d), salt) for d in ds] for m, ds in found.items()}


def digest_tensors(raw: dict[str, list[bytes]]) -> dict[str, list[torch.Tensor]]:
    """``{<modality>_digest: [uint8 tensor per file]}``: the form a digest travels in between M*'s workers."""
    return {f"{m}_digest": [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in ds]
            for m, ds in raw.items() if ds}


def install_digests(worker, params: dict[str, object], known: Known | None = None, stand_ins=None) -> None:
    """Make ``worker`` (an M* ``DataWorker``) add ``<modality>_digest`` tensors to every request it preprocesses,
    each the digest of the very bytes its model decodes.

    Wraps the instance's ``_process_input`` (read each file of the request once and digest those bytes), its model's
    ``load_image``/``load_audio``/``load_video`` (decode the bytes read, ``media_bytes.decode_from``, never the path
    again) and ``process_prompt`` (merge the digests into the tensors it returns); the classes and M*'s files are
    untouched. Idempotent.

    ``known`` (a presence oracle, ``mmcache.mstar.decode_skip``): when every media item of a request is known (and
    its stand-ins are in ``stand_ins``' side table, default ``stand_ins_for(worker.model)``), the request is neither
    decoded nor preprocessed: the loaders and the model's processors return stand-ins, the digests travel as usual.
    """
    if getattr(worker, "_mmcache_digests", False):
        return
    unknown = set(params) - set(_MEDIA)
    if unknown:
        raise InvalidRequest(f"no media digest for modalities {sorted(unknown)}; known: {sorted(_MEDIA)}")
    pending = threading.local()
    model = worker.model
    if known is not None:
        stand_ins = stand_ins if stand_ins is not None else stand_ins_for(model)
        stand_ins.install(model)
    process_input, process_prompt = worker._process_input, model.process_prompt

    def skippable(input, raw: dict[str, list[bytes]]) -> dict | None:
        """The stand-ins of a request whose every media item is known (and now held for it), else None."""
        if known is None or not any(raw.values()) or set(input.file_paths or {}) - set(raw):
            return None
        stored = stand_ins.lookup(raw)
        if stored is None:
            return None
        keys = {MediaKey(input.request_id, m, d) for m, ds in raw.items() for d in ds}
        return stored if known(sorted(keys, key=repr)) >= keys else None

    @functools.wraps(process_input)
    def _process_input(input):
        salt = request_salt(input.model_kwargs, "model_kwargs")  # a bad salt is refused before anything is read
        pending.blobs = read_request_files(input.file_paths)
        found = digest_files(input.file_paths or {}, params, pending.blobs)
        pending.raw = carried(found, salt)
        if routed := [d for ds in pending.raw.values() for d in ds]:  # a fresh dict: the caller's stays as it was
            input.model_kwargs = {**(input.model_kwargs or {}), ROUTE_MEDIA_KWARG: routed}
        pending.tensors = digest_tensors(pending.raw)
        pending.skip = stored = skippable(input, pending.raw)
        if stored is not None:
            stand_ins.begin(stored)
        try:
            return process_input(input)
        finally:
            if stored is not None:
                stand_ins.end()
            pending.blobs = pending.tensors = pending.raw = pending.skip = None

    @functools.wraps(process_prompt)
    def _process_prompt(*args, **kwargs):
        out = process_prompt(*args, **kwargs) or {}
        if known is not None and getattr(pending, "raw", None) and getattr(pending, "skip", None) is None:
            stand_ins.record(pending.raw, out)
        return {**out, **(getattr(pending, "tensors", None) or {})}

    def from_bytes(modality: str, load):
        @functools.wraps(load)
        def _load(filepath, device):
            if getattr(pending, "skip", None) is not None:
                return stand_ins.raw(modality)
            data = (getattr(pending, "blobs", None) or {}).get((modality, os.fspath(filepath)))
            if data is None:  # called outside a request this worker preprocesses
                return load(filepath, device)
            return decode_from(load, data, device, Path(os.fspath(filepath)).suffix)
        return _load

    for modality in _MEDIA:
        name = f"load_{modality}"
        setattr(model, name, from_bytes(modality, getattr(model, name)))
    worker._process_input, model.process_prompt = _process_input, _process_prompt
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
