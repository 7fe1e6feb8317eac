"""``voice-clone``: one-reference voice cloning with CSM, served up to its first audio chunk, with the codec encoder
store and the prefix cache off or on.

Model: ``CsmForConditionalGeneration`` (Sesame's Conversational Speech Model as ported to transformers): a Llama-style
backbone over a prompt of text tokens and audio frames predicts codebook 0 of the next frame, a small depth decoder
predicts codebooks 1..K-1 from the backbone's last hidden state, and the Mimi codec turns frames into 24 kHz audio.
With ``options.model`` the workload loads a real checkpoint (e.g. sesame/csm-1b) and its tokenizer from that folder;
otherwise the tiny CSM of ``workloads.fixtures`` with the Mistral SentencePiece tokenizer. The prompt template, row
embedding and frame step are ``mmcache.hf.csm``; the request lifecycle and decode loop ``mmcache.hf.runner``.

Prompt (CSM's chat template, speaker 0 throughout): one segment per line, ``bos "[0]" text eos``, followed for a line
with audio by one ``audio_token`` per frame and one ``audio_eos_token``. A request's lines are the reference
transcript with the reference audio, then each earlier turn of its session with the frames that turn generated, then
the target text. Text rows are ``embed_text_tokens`` of the ids, audio rows the backbone's summed codebook embeddings
of the frames, the audio-eos row the embedding of an all-``codebook_eos`` frame: what ``CsmForConditionalGeneration``
builds from ``input_ids`` and ``input_values``.

Per request: the reference WAV is Mimi-encoded into codes [frames, K] through the ``EncoderStore`` (modality
"audio", keyed by the digest of the WAV as sent; a hit skips the WAV decode, resampling and the codec encoder); the
prompt is admitted on a ``PagedKVCache`` whose page names carry the reference's digest (and each generated segment's
digest) at its first audio row, so pages match only behind the same text and the same audio; the rest is prefilled in
page-sized chunks; then ``max_new_tokens`` frames are decoded greedily (backbone step, then the depth decoder's K-1
steps, ``clock.token()`` per frame) and every ``AUDIO_CHUNK_FRAMES`` frames are decoded by Mimi into an audio chunk
(``clock.audio_chunk()``: the first one is the time to first audio). Cache off: the WAV is decoded and encoded and the
whole prompt prefilled, on a ``DynamicCache``, every time.

Invariants:
- exact: with the cache on, every request's frames and audio chunks equal the cache-off run's bit for bit. Every
  prompt position is computed in a forward over the same page-aligned span in both runs (``runner.chunk_spans``
  with one page per chunk, so a cached page was computed by the chunk of exactly that page), from rows embedded by
  the same calls: an audio segment is always embedded whole;
- only full prompt pages are indexed (``finish`` with no output ids): generated frames enter the index when the next
  turn sends them back as part of its prompt, named by their digest, since a page name fixed before generation
  cannot commit to frames not yet generated;
- a reference that cannot be read or decoded raises ``InvalidMedia`` before anything is admitted, so a failed request
  leaves both caches as they were; a turn whose earlier turn failed raises ``InvalidRequest``.

Frames per request are exactly ``max_new_tokens`` (no stop at the end-of-audio frame), so the cost and the prompt
layout of the next turn never depend on sampling; chunks are decoded one by one, because transformers' Mimi decoder
keeps no streaming state (a streaming decoder would carry its convolution state across chunks).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import wave
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

import digests
from encoders.codec import CachedCodecEncoder
from mmcache import EncoderStore, Fingerprint, PagePool, PrefixCache, ShadowIndex
from mmcache.errors import InvalidMedia, InvalidRequest
from mmcache.hf import runner
from mmcache.hf.csm import CsmSpeech, Template, frames_digest
from mmcache.hf.paged_kv import PagedKVCache, kv_page_shape
from mmcache.module_fingerprint import module_fingerprint
from workloads import fixtures
from workloads.harness.metrics import RequestResult
from workloads.harness.serving import Clock, Request
from workloads.models.text import prefix_ceiling
from workloads.options import ModelWorkloadOptions
from workloads.traces.seedtts import SEEDTTS, load_seedtts
from workloads.traces.voice_clone_turns import AUDIO_CHUNK_FRAMES, sentence

NAME = "voice-clone"
SESSION = "voice"               # session id of the voice-session turns
SESSION_TURNS = 4
ROW_GAP_S, TURN_GAP_S, TURN_START_S = 0.5, 1.0, 0.25  # trace arrivals (s): rows, session turns, interleaved


# ------------------------------------------------------------------------------------------------------- requests
@dataclasses.dataclass(frozen=True)
class VoiceTurn:
    """One request: say ``text`` in the voice of ``reference`` (WAV bytes or a path, read at serve time) whose
    transcript is ``reference_text``, after ``history``: the ``(rid, text)`` of the session's earlier turns, whose
    generated frames follow their text in the prompt."""

    reference: bytes | Path
    reference_text: str
    text: str
    history: tuple[tuple[str, str], ...] = ()


def _session(reference: bytes | Path, reference_text: str, texts: Sequence[str]) -> list[Request]:
    out, history = [], ()
    for t, text in enumerate(texts):
        rid = f"{SESSION}/t{t}"
        out.append(Request(rid, SESSION, TURN_START_S + TURN_GAP_S * t,
                           VoiceTurn(reference, reference_text, text, history)))
        history += ((rid, text),)
    return out


def _rows(rows: Sequence[tuple[str, bytes | Path, str, str]]) -> list[Request]:
    """Seed-TTS style rows ``(rid, reference, reference_text, text)``: one request each, its own session."""
    return [Request(rid, rid, ROW_GAP_S * i, VoiceTurn(ref, ref_text, text)) for i, (rid, ref, ref_text, text)
            in enumerate(rows)]


def tone_wav(speaker: int, seed: int = 0) -> bytes:
    """A 24 kHz mono 16-bit WAV written with the stdlib ``wave`` module, different per speaker: a vibrato tone and its
    harmonics over a rising chirp and a little noise, 1.3 to 2.7 seconds long."""
    rng = np.random.default_rng([seed, speaker])
    rate, seconds = 24000, 1.3 + 0.7 * (speaker % 3)
    t = np.arange(int(rate * seconds)) / rate
    f0 = 110.0 * 1.37 ** speaker * (1 + 0.03 * np.sin(2 * np.pi * 5 * t))
    phase = 2 * np.pi * np.cumsum(f0) / rate
    x = sum(0.25 / h * np.sin(h * phase) for h in (1, 2, 3))
    x = x + 0.1 * np.sin(2 * np.pi * (300 + 400 * t / seconds) * t) + 0.02 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setparams((1, 2, rate, 0, "NONE", "not compressed"))
        w.writeframes(np.round(np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def embedded_requests(seed: int = 0, speakers: int = 3) -> list[Request]:
    """The default with no data: ``speakers`` generated references, each serving 2 rows (as in Seed-TTS-Eval), and a
    voice session of ``SESSION_TURNS`` turns in speaker 0's voice; transcripts drawn from a small vocabulary."""
    rng = np.random.default_rng(seed)
    refs = [(tone_wav(s, seed), sentence(rng)) for s in range(speakers)]
    rows = [(f"spk{s}/row{j}", *refs[s], sentence(rng)) for s in range(speakers) for j in range(2)]
    return sorted(_rows(rows) + _session(*refs[0], [sentence(rng) for _ in range(SESSION_TURNS)]),
                  key=lambda r: r.arrival_s)


def seedtts_requests(meta: str | Path) -> list[Request]:
    """Rows of a Seed-TTS-Eval ``meta.lst`` (``seedtts.load_seedtts``: ``TraceError`` for a bad line), then a voice
    session in the first row's voice whose turns say the rows' target texts."""
    rows = load_seedtts(meta)
    session = _session(rows[0].wav, rows[0].transcript, [row.text for row in rows[:SESSION_TURNS]])
    return sorted(_rows(rows) + session, key=lambda r: r.arrival_s)


def load_requests(options: ModelWorkloadOptions) -> list[Request]:
    """Seed-TTS rows under ``options.data`` when given, else the embedded default; the first ``options.limit`` in
    arrival order (a session keeps its first turns)."""
    reqs = seedtts_requests(Path(options.data) / SEEDTTS) if options.data is not None else \
        embedded_requests(options.seed)
    return reqs[:options.limit]


# ------------------------------------------------------------------------------------------------------- workload
@dataclasses.dataclass(frozen=True)
class VoiceOutput:
    """What one request produced: frames ``codes`` [max_new_tokens, K] and the Mimi audio chunks, first to last."""

    codes: torch.Tensor
    audio: tuple[torch.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class VoiceCloneFactory:
    """What ``factory`` loads once: the model, its template, the requests and both fingerprints. Calling it gives a
    fresh ``VoiceClone`` whose caches start empty."""

    model: object           # CsmForConditionalGeneration
    template: Template
    requests: tuple[Request, ...]
    options: ModelWorkloadOptions
    fingerprint: str        # the whole model: backbone, embeddings, depth decoder and codec (the codes a page holds)
    codec_fingerprint: str
    folder: Path            # where the model was loaded from

    def __call__(self) -> VoiceClone:
        return VoiceClone(self)


def factory(options: ModelWorkloadOptions) -> VoiceCloneFactory:
    """Load the model and requests once and warm every stage up (cache off and on), so first-call costs land on
    neither measured run."""
    if options.max_new_tokens < 1:
        raise ValueError(f"voice-clone generates max_new_tokens frames per request: need >= 1, got "
                         f"{options.max_new_tokens}")
    model, tokenizer, folder = fixtures.load_csm(options)
    made = VoiceCloneFactory(model, Template.for_model(model, tokenizer), tuple(load_requests(options)), options,
                             module_fingerprint(model), module_fingerprint(model.codec_model), Path(folder))
    warm = dataclasses.replace(made, requests=tuple(embedded_requests(options.seed, speakers=1)[:1]))()
    for cached in (False, True):
        warm.serve(warm.requests()[0], cached, Clock())
    return made


class VoiceClone:
    """The ``voice-clone`` workload (see the module docstring). ``outputs[rid]`` keeps each completed request's
    ``VoiceOutput``; a session's next turn reads its earlier turns' frames from there."""

    name = NAME

    def __init__(self, made: VoiceCloneFactory):
        self.made, self.model, self.template = made, made.model, made.template
        opts, cfg = made.options, made.model.config
        self.page_size, self.frames_per_request = opts.page_size, opts.max_new_tokens
        p = next(self.model.parameters())
        pool = PagePool(opts.pool_pages, kv_page_shape(cfg, opts.page_size), p.dtype, p.device)
        fp = Fingerprint(model=made.fingerprint, kv_dtype=str(p.dtype), attention_backend=cfg._attn_implementation,
                         page_size=opts.page_size)
        self.kv = PagedKVCache(PrefixCache(pool, fp, vocab_size=cfg.text_vocab_size), cfg)
        self.store = EncoderStore(capacity_bytes=opts.encoder_bytes, page_bytes=4096)
        self.codecs = {cached: CachedCodecEncoder(self.model.codec_model, self.store if cached else None,
                                                  fingerprint=made.codec_fingerprint) for cached in (False, True)}
        self.codec = self.codecs[True]
        self.speech = CsmSpeech(self.model)
        self.outputs: dict[str, VoiceOutput] = {}

    def requests(self) -> list[Request]:
        return list(self.made.requests)

    def serve(self, req: Request, cached: bool, clock: Clock) -> RequestResult:
        turn: VoiceTurn = req.payload
        earlier = [self.outputs.get(rid) for rid, _ in turn.history]
        if None in earlier:
            raise InvalidRequest(f"turn {req.rid!r} follows {turn.history[earlier.index(None)][0]!r}, which did not "
                                 f"complete")
        codec = self.codecs[cached]
        data = codec.read(turn.reference)
        with clock.stage("audio"):
            digest = codec.digest(data) if cached else None
            found = codec.lookup(data, digest=digest)
        ref = found.value
        audio = [ref, *(o.codes for o in earlier)]
        ids, offsets = self.template.layout([(turn.reference_text, len(ref)),
                                             *((text, len(o.codes)) for (_, text), o in zip(turn.history, earlier)),
                                             (turn.text, None)])
        marks = [(offsets[0], digest), *((off, frames_digest(a)) for off, a in zip(offsets[1:], audio[1:]))] \
            if cached else ()
        chunks: list[torch.Tensor] = []

        def on_frame(step: int, frames: list) -> None:
            clock.token()
            if (step + 1) % AUDIO_CHUNK_FRAMES == 0 or step + 1 == self.frames_per_request:
                with clock.stage("vocode"):
                    chunks.append(self.speech.vocode(frames[len(chunks) * AUDIO_CHUNK_FRAMES:]))
                clock.audio_chunk()

        # only prompt pages are indexed (see the module docstring): the lease's output_ids stay empty
        with runner.request(self.kv if cached else None, req.rid, ids, config=self.model.config,
                            media=marks) as lease:
            frames = self.speech.generate(lease.cache, ids, list(zip(offsets, audio)), lease.matched_tokens,
                                          frames=self.frames_per_request, chunk_tokens=self.page_size,
                                          on_frame=on_frame, stage=clock.stage)
        out = self.outputs[req.rid] = VoiceOutput(torch.stack(frames), tuple(chunks))
        P, n, matched = self.page_size, len(ids), lease.matched_tokens
        return RequestResult(prompt_tokens=n, hit_tokens=matched, prompt_pages=n // P, hit_pages=matched // P,
                             output_tokens=len(out.codes), encoder_items={"audio": 1},
                             encoder_hits={"audio": int(found.hit)})

    def cache_stats(self) -> dict:
        return {"prefix": self.kv.prefix.stats().to_dict(), "encoder": self.store.stats().to_dict()}

    def ceilings(self) -> dict[str, float]:
        """Unbounded-cache hit rates over the requests that will succeed (a reference that decodes), in service
        order: ``audio`` = repeated references / references, ``prefix`` = tokens a ``ShadowIndex`` matches / prompt
        tokens, with the same layout and marks as ``serve``. A generated segment's digest is stood in for by one per
        generating turn: the real ones are equal exactly where those are (the same turn's frames)."""
        return self._ceilings[0]

    def ceiling_weights(self) -> dict[str, int]:
        """What each ceiling is a share of (prompt tokens, references), so a blend of workloads can weigh them."""
        return self._ceilings[1]

    @functools.cached_property
    def _ceilings(self) -> tuple[dict[str, float], dict[str, int]]:
        shadow = ShadowIndex(self.kv.prefix.fingerprint)
        frames: dict[digests.Digest, int] = {}
        items = hits = 0
        for req in self.requests():
            turn: VoiceTurn = req.payload
            try:
                data = self.codec.read(turn.reference)
                digest = self.codec.digest(data)
                if digest in frames:
                    hits += 1
                else:
                    frames[digest] = self.codec.reference_frames(data)
            except InvalidMedia:
                continue
            items += 1
            ids, offsets = self.template.layout([(turn.reference_text, frames[digest]),
                                                 *((text, self.frames_per_request) for _, text in turn.history),
                                                 (turn.text, None)])
            marks = [(offsets[0], digest),
                     *((off, digests.prompt([], {"generated_by": rid})) for off, (rid, _) in
                       zip(offsets[1:], turn.history))]
            shadow.admit(req.rid, ids, media=marks)
            shadow.finish(req.rid)
        return ({"prefix": prefix_ceiling(shadow), "audio": hits / items if items else 0.0},
                {"prefix": sum(r.prompt_tokens for r in shadow.records), "audio": items})

