"""``voice-clone``: one-reference voice cloning with CSM, served up to its first audio chunk, with the codec encoder
store and the prefix cache off or on.

Model: ``CsmForConditionalGeneration`` (Sesame's Conversational Speech Model as ported to transformers): a Llama-style
backbone over a prompt of text tokens and audio frames predicts codebook 0 of the next frame, a small depth decoder
predicts codebooks 1..K-1 from the backbone's last hidden state, and the Mimi codec turns frames into 24 kHz audio.
With ``options.model`` the workload loads a real checkpoint (e.g. sesame/csm-1b) and its tokenizer from that folder;
otherwise a tiny random-weight CSM is built from config, saved under ``options.model_dir`` with ``save_pretrained``
(reused when present) and loaded back with ``from_pretrained``, with the Mistral SentencePiece tokenizer that ships
in ``mistral_common``.

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
  prompt position is computed in a forward over the same page-aligned span in both runs (``prefill.chunk_spans``
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
import os
import shutil
import wave
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from transformers import AutoTokenizer, CsmConfig, CsmForConditionalGeneration, DynamicCache, MimiConfig
from transformers.cache_utils import Cache
from transformers.models.csm.configuration_csm import CsmDepthDecoderConfig
from transformers.models.mimi.modeling_mimi import MimiEuclideanCodebook

import digests
from encoders.base import module_fingerprint
from encoders.audio import CachedWavEncoder
from mmcache.hf.paged_kv import PagedKVCache, kv_page_shape
from mmcache.hf.runner import chunk_spans
from mmcache import EncoderStore, Fingerprint, PagePool, PrefixCache, ShadowIndex
from mmcache.errors import EncoderOutputError, InvalidMedia, InvalidRequest, TraceError

from workloads.harness.metrics import RequestResult
from workloads.options import ModelWorkloadOptions
from workloads.harness.serving import Clock, Request
from workloads.traces.swe_agent import load_tokenizer

NAME = "voice-clone"
TINY_MODEL = "csm-tiny"         # folder under options.model_dir (suffixed with the seed it was built with)
AUDIO_CHUNK_FRAMES = 2          # Mimi frames per audio chunk: 160 ms at 12.5 frames/s
SESSION = "voice"               # session id of the voice-session turns
SESSION_TURNS = 4
ROW_GAP_S, TURN_GAP_S, TURN_START_S = 0.5, 1.0, 0.25  # trace arrivals (s): rows, session turns, interleaved
SEEDTTS = "seedtts/meta.lst"    # under options.data
_WORDS = ("the", "a", "quiet", "river", "light", "morning", "voice", "carries", "over", "green", "hills", "we",
          "found", "seven", "small", "boats", "near", "old", "harbor", "wind", "turns", "slowly", "before", "rain",
          "every", "story", "begins", "with", "one", "clear", "sound", "and", "ends", "far", "away", "today")


# ---------------------------------------------------------------------------------------------------------- model
def tiny_config() -> CsmConfig:
    """A CSM small enough for a CPU test: 8 codebooks of 64 codes, a 2-layer backbone over the 32,768-piece Mistral
    vocabulary, a 1-layer depth decoder and a narrow Mimi with the real frame rate (12.5 Hz at 24 kHz)."""
    k, codes, hidden = 8, 64, 64
    mimi = MimiConfig(hidden_size=32, num_filters=4, codebook_size=codes, codebook_dim=16, num_quantizers=k,
                      vector_quantization_hidden_dimension=16, upsample_groups=32, num_hidden_layers=1,
                      intermediate_size=64, num_attention_heads=2, num_key_value_heads=2)
    depth = CsmDepthDecoderConfig(num_codebooks=k, backbone_hidden_size=hidden, vocab_size=codes, hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, max_position_embeddings=k + 1)
    # audio tokens: two control pieces of the Mistral vocabulary ([control_12], [control_13]) that text never yields
    return CsmConfig(num_codebooks=k, vocab_size=codes, text_vocab_size=32768, hidden_size=hidden,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     codebook_pad_token_id=codes - 1, codebook_eos_token_id=0, audio_token_id=14,
                     audio_eos_token_id=15, bos_token_id=1, pad_token_id=0, depth_decoder_config=depth.to_dict(),
                     codec_config=mimi.to_dict())


def build_tiny(folder: Path, seed: int) -> None:
    """Save a random-weight ``tiny_config()`` CSM to ``folder``. Mimi initialises its codebooks to zeros (every
    frame would quantize to code 0), so they are drawn at random. Written to a temporary folder and renamed, so a
    concurrent builder never sees half a model."""
    torch.manual_seed(seed)
    model = CsmForConditionalGeneration(tiny_config())
    for book in model.codec_model.modules():
        if isinstance(book, MimiEuclideanCodebook):
            book.embed_sum.normal_()
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process built it first
        shutil.rmtree(tmp)


@dataclasses.dataclass(frozen=True)
class Template:
    """CSM's prompt template over a tokenizer: ``encode(text)`` gives ids without special tokens."""

    encode: Callable[[str], Sequence[int]]
    bos: int
    eos: int
    audio: int
    audio_eos: int

    def layout(self, lines: Sequence[tuple[str, int | None]]) -> tuple[list[int], list[int]]:
        """Token ids of ``lines`` (text, audio frames or None) and the offset of each audio segment's first frame."""
        ids, offsets = [], []
        for text, frames in lines:
            ids += [self.bos, *self.encode(f"[0]{text}"), self.eos]
            if frames is not None:
                offsets.append(len(ids))
                ids += [self.audio] * frames + [self.audio_eos]
        return ids, offsets


def load_model(options: ModelWorkloadOptions) -> tuple[CsmForConditionalGeneration, Template]:
    """The model in eval mode and its prompt template: ``options.model`` with its own tokenizer, else the tiny model
    (built on first use) with the Mistral SentencePiece tokenizer."""
    if options.model is not None:
        model = CsmForConditionalGeneration.from_pretrained(options.model).eval()
        tok = AutoTokenizer.from_pretrained(options.model)
        encode, bos, eos = (lambda s: tok(s, add_special_tokens=False).input_ids), tok.bos_token_id, tok.eos_token_id
    else:
        folder = Path(options.model_dir) / f"{TINY_MODEL}-s{options.seed}"
        if not (folder / "config.json").is_file():
            folder.parent.mkdir(parents=True, exist_ok=True)
            build_tiny(folder, options.seed)
        model = CsmForConditionalGeneration.from_pretrained(folder).eval()
        sp = load_tokenizer()
        encode, bos, eos = sp.encode, sp.bos_id(), sp.eos_id()
    c = model.config
    return model, Template(encode, bos, eos, c.audio_token_id, c.audio_eos_token_id)


class CachedCodecEncoder(CachedWavEncoder):
    """A reference WAV -> Mimi codes [frames, num_codebooks] (int64), keyed under modality "audio".

    The codec takes the raw mono waveform at its sampling rate as ``[1, 1, samples]`` (what CSM's feature extractor
    hands it), so the digest params are the codec's rate and codebook count (plus the base's resampler and downmix).
    Invariant: the output has exactly ``frames(samples)`` rows, so a prompt's layout follows from the WAV alone.
    """

    modality = "audio"

    def __init__(self, codec, store: EncoderStore | None, *, fingerprint: str | None = None):
        c = codec.config
        self.num_codebooks = c.num_quantizers
        super().__init__(codec, store, {"codec": "mimi", "input": "waveform", "num_quantizers": c.num_quantizers},
                         c.sampling_rate, fingerprint=fingerprint)

    def frames(self, samples: int) -> int:
        """Codec frames of ``samples`` mono samples at the codec's rate."""
        return int(self.module.get_encoded_length(torch.tensor(samples)))

    def reference_frames(self, data: bytes) -> int:
        """Frames the codes of WAV bytes ``data`` will have (decodes and resamples, runs no codec)."""
        return self.frames(self.mono(*self.decode(data)).shape[-1])

    def compute(self, data) -> torch.Tensor:
        waveform, rate = data if isinstance(data, tuple) else self.decode(data)
        mono = self.mono(waveform, rate)
        with torch.inference_mode():
            codes = self.module.encode(mono[None].to(self.device, self.dtype)).audio_codes[0].T
        want = (self.frames(mono.shape[-1]), self.num_codebooks)
        if tuple(codes.shape) != want or codes.dtype != torch.long:
            raise EncoderOutputError(f"the codec gave {tuple(codes.shape)} {codes.dtype} codes, expected {want} "
                                     f"torch.int64")
        return codes.contiguous()


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


def sentence(rng: np.random.Generator) -> str:
    """A transcript of 6 to 12 words from the embedded vocabulary."""
    words = rng.choice(_WORDS, int(rng.integers(6, 13)))
    return " ".join(words).capitalize() + "."


def embedded_requests(seed: int = 0, speakers: int = 3) -> list[Request]:
    """The default with no data: ``speakers`` generated references, each serving 2 rows (as in Seed-TTS-Eval), and a
    voice session of ``SESSION_TURNS`` turns in speaker 0's voice; transcripts drawn from a small vocabulary."""
    rng = np.random.default_rng(seed)
    refs = [(tone_wav(s, seed), sentence(rng)) for s in range(speakers)]
    rows = [(f"spk{s}/row{j}", *refs[s], sentence(rng)) for s in range(speakers) for j in range(2)]
    return sorted(_rows(rows) + _session(*refs[0], [sentence(rng) for _ in range(SESSION_TURNS)]),
                  key=lambda r: r.arrival_s)


def seedtts_requests(meta: str | Path) -> list[Request]:
    """Rows of a Seed-TTS-Eval ``meta.lst`` (``utt_id|prompt_text|prompt_wav|target_text``, WAV paths relative to
    it), then a voice session in the first row's voice whose turns say the rows' target texts; ``TraceError`` (file
    and line) for a line without four fields."""
    meta = Path(meta)
    try:
        lines = meta.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TraceError(meta, None, str(e)) from e
    rows = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            fields = line.split("|")
            if len(fields) != 4 or not all(f.strip() for f in fields):
                raise TraceError(meta, n, f"expected utt_id|prompt_text|prompt_wav|target_text, got {line!r}")
            rid, ref_text, wav_path, text = (f.strip() for f in fields)
            rows.append((rid, meta.parent / wav_path, ref_text, text))
    if not rows:
        raise TraceError(meta, None, "no rows")
    session = _session(rows[0][1], rows[0][2], [text for *_, text in rows[:SESSION_TURNS]])
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

    model: CsmForConditionalGeneration
    template: Template
    requests: tuple[Request, ...]
    options: ModelWorkloadOptions
    fingerprint: str        # the whole model: backbone, embeddings, depth decoder and codec (the codes a page holds)
    codec_fingerprint: str

    def __call__(self) -> VoiceClone:
        return VoiceClone(self)


def factory(options: ModelWorkloadOptions) -> VoiceCloneFactory:
    """Load the model and requests once and warm every stage up (cache off and on), so first-call costs land on
    neither measured run."""
    if options.max_new_tokens < 1:
        raise ValueError(f"voice-clone generates max_new_tokens frames per request: need >= 1, got "
                         f"{options.max_new_tokens}")
    model, template = load_model(options)
    made = VoiceCloneFactory(model, template, tuple(load_requests(options)), options, module_fingerprint(model),
                             module_fingerprint(model.codec_model))
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
        self.codec = CachedCodecEncoder(self.model.codec_model, self.store, fingerprint=made.codec_fingerprint)
        with torch.inference_mode():
            eos = torch.full((1, 1, cfg.num_codebooks), cfg.codebook_eos_token_id, device=p.device)
            self._eos_row = self.model.backbone_model.embed_tokens(eos)[0]
        self.outputs: dict[str, VoiceOutput] = {}

    def requests(self) -> list[Request]:
        return list(self.made.requests)

    def serve(self, req: Request, cached: bool, clock: Clock) -> RequestResult:
        turn: VoiceTurn = req.payload
        earlier = [self.outputs.get(rid) for rid, _ in turn.history]
        if None in earlier:
            raise InvalidRequest(f"turn {req.rid!r} follows {turn.history[earlier.index(None)][0]!r}, which did not "
                                 f"complete")
        data = _read(turn.reference)
        with clock.stage("audio"):
            if cached:
                key = self.codec.key(data)
                hit = key in self.store
                ref = self.store.get_or_compute(key, lambda: self.codec.compute(data)).value.to(self.codec.device)
            else:
                ref, hit = self.codec.compute(data), False
        audio = [ref, *(o.codes for o in earlier)]
        ids, offsets = self.template.layout([(turn.reference_text, len(ref)),
                                             *((text, len(o.codes)) for (_, text), o in zip(turn.history, earlier)),
                                             (turn.text, None)])
        matched = 0
        if cached:
            marks = [(offsets[0], key.digest), *((off, _frames_digest(a)) for off, a in zip(offsets[1:], audio[1:]))]
            matched = self.kv.admit(req.rid, ids, media=marks).matched_tokens
        try:
            out = self._generate(ids, list(zip(offsets, audio)), matched,
                                 self.kv if cached else DynamicCache(config=self.model.config), clock)
        except BaseException:
            if cached:
                self.kv.abort(req.rid)
            raise
        if cached:
            self.kv.finish(req.rid)
        self.outputs[req.rid] = out
        P, n = self.page_size, len(ids)
        return RequestResult(prompt_tokens=n, hit_tokens=matched, prompt_pages=n // P, hit_pages=matched // P,
                             output_tokens=len(out.codes), encoder_items={"audio": 1},
                             encoder_hits={"audio": int(hit)})

    @torch.inference_mode()
    def _generate(self, ids: list[int], audio: list[tuple[int, torch.Tensor]], start: int, cache: Cache,
                  clock: Clock) -> VoiceOutput:
        """Prefill ``ids[start:]`` (the cache holds the first ``start``) in page-aligned chunks, then decode frames
        and audio chunks."""
        m = self.model
        x = self._embed(ids, audio, start)
        with clock.stage("prefill"):
            for a, b in chunk_spans(start, len(ids), self.page_size):
                # a fresh tensor per chunk: the same alignment in both runs, whatever ``start`` is
                h = m.backbone_model(inputs_embeds=x[:, a - start:b - start].clone(), cache=cache,
                                     use_cache=True).last_hidden_state[:, -1]
        frames, chunks = [], []
        for i in range(self.frames_per_request):
            with clock.stage("decode"):
                frames.append(self._frame(h))
            clock.token()
            if (i + 1) % AUDIO_CHUNK_FRAMES == 0 or i + 1 == self.frames_per_request:
                with clock.stage("vocode"):
                    codes = torch.stack(frames[len(chunks) * AUDIO_CHUNK_FRAMES:])
                    chunks.append(m.codec_model.decode(codes.T[None]).audio_values[0, 0])
                clock.audio_chunk()
            if i + 1 < self.frames_per_request:  # the last frame is returned, never fed
                with clock.stage("decode"):
                    step = m.backbone_model.embed_tokens(frames[-1][None, None])
                    h = m.backbone_model(inputs_embeds=step, cache=cache, use_cache=True).last_hidden_state[:, -1]
        return VoiceOutput(torch.stack(frames), tuple(chunks))

    def _embed(self, ids: list[int], audio: list[tuple[int, torch.Tensor]], start: int) -> torch.Tensor:
        """``inputs_embeds`` [1, len(ids) - start, hidden] of prompt rows ``[start, len(ids))``. An audio segment that
        reaches past ``start`` is embedded whole (frames, then the audio-eos row), so its rows never depend on
        ``start``."""
        m = self.model
        x = m.embed_text_tokens(torch.tensor(ids[start:], device=m.device)[None])
        for off, codes in audio:
            end = off + len(codes) + 1
            if end > start:
                rows = torch.cat([m.backbone_model.embed_tokens(codes[None])[0], self._eos_row])
                lo = max(off, start)
                x[0, lo - start:end - start] = rows[lo - off:]
        return x

    def _frame(self, hidden: torch.Tensor) -> torch.Tensor:
        """One frame's K codes, greedy, from the backbone's last hidden state [1, hidden]: codebook 0 from ``lm_head``,
        codebooks 1..K-1 from the depth decoder fed [placeholder, code 0] with the hidden state in the placeholder's
        row, then one code per step (as ``CsmForConditionalGeneration.generate`` does)."""
        m = self.model
        code = m.lm_head(hidden).argmax(-1, keepdim=True)
        ids, codes = torch.cat([torch.zeros_like(code), code], 1), [code]
        cache, first = DynamicCache(config=m.depth_decoder.config), {"backbone_last_hidden_state": hidden}
        for _ in range(m.config.num_codebooks - 1):
            logits = m.depth_decoder(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1, **first).logits
            ids, first = logits[:, -1].argmax(-1, keepdim=True), {}
            codes.append(ids)
        return torch.cat(codes, 1)[0]

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
                data = _read(turn.reference)
                digest = self.codec.key(data).digest
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
        prompt = sum(r.prompt_tokens for r in shadow.records)
        matched = sum(r.matched_pages for r in shadow.records) * self.page_size
        return ({"prefix": matched / prompt if prompt else 0.0, "audio": hits / items if items else 0.0},
                {"prefix": prompt, "audio": items})


def _frames_digest(codes: torch.Tensor) -> digests.Digest:
    """The name of generated frames [frames, K] in a later turn's page chain."""
    return digests.prompt(codes.reshape(-1), {"csm_frames": list(codes.shape)})


def _read(reference: bytes | Path) -> bytes:
    if isinstance(reference, bytes):
        return reference
    try:
        return Path(reference).read_bytes()
    except OSError as e:
        raise InvalidMedia(f"cannot read reference WAV {os.fspath(reference)!r}: {e}") from e
