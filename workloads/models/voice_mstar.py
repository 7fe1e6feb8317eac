"""``voice-mstar``: zero-shot voice cloning with M*'s Orpheus (LLM + SNAC decoder), served many-in-flight through M*'s
real ``Engine`` (``workloads.harness.mstar_serving``), with mmcache's KV resource under the LLM or M*'s own.

Requests: ``voice_clone.load_requests`` (Seed-TTS-Eval rows under ``--data``, else its embedded default): several users
per reference voice, each its own session, and one multi-turn session in the first voice. A request's prompt is
Orpheus's cloning-by-continuation layout, one segment per line of the conversation, in Orpheus's own token roles:

    [start of human] text [end of text] [end of human] [start of AI] [start of speech] audio codes [end of speech]
    [end of AI]

for the reference (its transcript, then its audio as SNAC codes) and for each earlier turn of the session (its text,
then the codes that turn generated), then the target: ``[start of human] text`` + the config's ``end_token_ids``
(``[end of text] [end of human] [start of AI] [start of speech]``: what M*'s ``OrpheusModel.process_prompt`` wraps a
prompt in). So every user of a voice shares the reference segment as a prefix, and a session's turn re-sends all of
the turn before it, its generated codes included.

Tokens (a tiny Orpheus layout, same roles as Orpheus's 128256-based one): text ids are the UTF-8 bytes (0..255),
``[end of text]`` 256, pad 257, ``custom_token_k`` = 258 + k (Orpheus's roles: 1 start of speech, 2 end of speech, 3
start of human, 4 end of human, 5 start of AI, 6 end of AI), and code ``c`` at slot ``j`` of a 7-code frame is
``custom_token_(10 + 4096 j + c)``, which M*'s ``SNACDecoderSubmodule._tokens_to_codes`` maps back to ``c``.
Reference codes come from the tiny SNAC's own encoder and quantizer (M*'s ``SNAC``; each WAV encoded once at load
time, not timed): frame ``i`` is ``[c0[i], c1[2i], c2[4i], c2[4i+1], c1[2i+1], c2[4i+2], c2[4i+3]]``, the order M*'s
``_extract_snac_codes`` reads.

``options.max_new_tokens`` is SNAC frames per request (as for ``voice-clone``): 7 codes each, generated greedily to the
end (no stop at end-of-speech), so a session's prompts never depend on when sampling would have stopped.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import xxhash

from digests import load_wav
from mmcache import ShadowIndex
from mmcache.errors import InvalidRequest
from workloads.harness.serving import Request
from workloads.models import voice_clone
from workloads.models.text import prefix_ceiling, trace_order
from workloads.options import ModelWorkloadOptions

NAME = "voice-mstar"
ENGINE = "M*'s Engine (mstar-ai 0.2.1: Orpheus LLM + SNAC decoder nodes)"
EOT, PAD, BASE = 256, 257, 258                      # end of text, pad, custom_token_0
SOS, EOS, SOH, EOH, SOA, EOA = (BASE + k for k in range(1, 7))
CODE0, CODEBOOK, CODES_PER_FRAME = BASE + 10, 4096, 7
SAMPLE_RATE = 24000


def orpheus_config():
    """The tiny ``OrpheusModelConfig`` of this layout (the LM of the tests' tiny Orpheus, the vocabulary widened to
    every code slot)."""
    from workloads.peers.mstar_orpheus import CFG

    return dataclasses.replace(CFG, vocab_size=CODE0 + CODES_PER_FRAME * CODEBOOK, custom_token_base_id=BASE,
                               start_token_id=SOH, end_token_ids=[EOT, EOH, SOA, SOS], stop_token_id=EOS,
                               pad_token_id=PAD, max_position_embeddings=8192)


def text_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def segment(text: str, codes: list[int]) -> list[int]:
    """One spoken line: its text as the human's turn, its codes as the AI's speech."""
    return [SOH, *text_ids(text), EOT, EOH, SOA, SOS, *codes, EOS, EOA]


def frames_to_tokens(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor) -> list[int]:
    """SNAC codes [F], [2F], [4F] as 7 tokens per frame (see the module docstring)."""
    out = []
    for i in range(c0.numel()):
        codes = (c0[i], c1[2 * i], c2[4 * i], c2[4 * i + 1], c1[2 * i + 1], c2[4 * i + 2], c2[4 * i + 3])
        out += [CODE0 + CODEBOOK * j + int(c) for j, c in enumerate(codes)]
    return out


def read_wav(reference: bytes | Path) -> torch.Tensor:
    """A PCM WAV (bytes or a path; decoded by ``digests.load_wav``, which raises ``InvalidMedia`` for anything else)
    as float samples in [-1, 1) at 24 kHz, mono (channels averaged)."""
    samples, rate = load_wav(reference)
    x = samples.mean(dim=0)
    if rate != SAMPLE_RATE:
        import torchaudio
        x = torchaudio.functional.resample(x, rate, SAMPLE_RATE)
    return x


@torch.no_grad()
def encode_reference(snac, samples: torch.Tensor) -> list[int]:
    """The reference's codes as tokens: M*'s ``SNAC`` encoder and quantizer over the samples, padded to whole frames
    (hop x the coarsest stride)."""
    hop = int(np.prod(snac.encoder_rates)) * max(snac.vq_strides)
    x = samples[None, None]
    x = torch.nn.functional.pad(x, (0, -x.shape[-1] % hop))
    _, codes = snac.quantizer(snac.encoder(x))
    return frames_to_tokens(*(c[0] for c in codes))


# ------------------------------------------------------------------------------------------------------- workload
@dataclasses.dataclass(frozen=True)
class VoiceMstarFactory:
    """What ``factory`` loads once: the weights' folders, the config, the requests and each reference's code tokens
    (by the reference as sent). Calling it gives a fresh ``VoiceMstar`` (nothing generated yet)."""

    weights: Path
    snac: Path
    cfg: object
    requests: tuple[Request, ...]
    references: dict
    options: ModelWorkloadOptions
    fingerprint: str            # names the weights (both folders' key) for the page names

    def __call__(self) -> VoiceMstar:
        return VoiceMstar(self)


def _ref_key(reference: bytes | Path) -> str:
    return xxhash.xxh3_128_hexdigest(reference if isinstance(reference, bytes) else Path(reference).read_bytes())


def factory(options: ModelWorkloadOptions) -> VoiceMstarFactory:
    """Save (once) and load the tiny Orpheus LLM and SNAC, read the requests, encode each reference once."""
    if options.model is not None:
        raise ValueError("voice-mstar serves a tiny Orpheus built from config (M*'s loader, random weights); it takes "
                         "no --model")
    if options.max_new_tokens < 1:
        raise ValueError(f"voice-mstar generates max_new_tokens SNAC frames per request: need >= 1, got "
                         f"{options.max_new_tokens}")
    from mstar.model.orpheus.components.snac import SNAC

    from workloads.peers.mstar_orpheus import save_snac, save_weights

    cfg = orpheus_config()
    weights, snac = save_weights(options.model_dir, cfg), save_snac(options.model_dir)
    reqs = tuple(voice_clone.load_requests(options))
    codec, refs = SNAC.from_pretrained(str(snac)).eval(), {}
    for req in reqs:
        key = _ref_key(req.payload.reference)
        if key not in refs:
            refs[key] = encode_reference(codec, read_wav(req.payload.reference))
    return VoiceMstarFactory(weights, snac, cfg, reqs, refs, options, f"orpheus-tiny/{weights.name}/{snac.name}")


class VoiceMstar:
    """The ``voice-mstar`` workload of one run (see the module docstring). ``outputs[rid]``: the code tokens a
    completed request generated; ``audio[rid]``: its audio chunks (int16), first to last."""

    name = NAME
    engine = ENGINE

    def __init__(self, made: VoiceMstarFactory):
        self.made, self.cfg = made, made.cfg
        self.page_size, self.pool_pages = made.options.page_size, made.options.pool_pages
        self.codes_per_request = CODES_PER_FRAME * made.options.max_new_tokens
        self.outputs: dict[str, list[int]] = {}
        self.audio: dict[str, list[torch.Tensor]] = {}

    def requests(self) -> list[Request]:
        return list(self.made.requests)

    def steps(self, cached: bool, sampled):
        """What drives this workload through M*'s engine (``workloads.harness.orpheus_steps``)."""
        from workloads.harness.orpheus_steps import OrpheusSteps

        return OrpheusSteps(self, cached, sampled)

    def prompt(self, req: Request, generated=None) -> list[int]:
        """``req``'s prompt token ids (the layout of the module docstring); a session's earlier turns' codes from
        ``generated`` (default: ``outputs``); ``InvalidRequest`` when an earlier turn has none."""
        generated = self.outputs if generated is None else generated
        turn = req.payload
        ids = segment(turn.reference_text, self.made.references[_ref_key(turn.reference)])
        for rid, text in turn.history:
            if rid not in generated:
                raise InvalidRequest(f"turn {req.rid!r} follows {rid!r}, which did not complete")
            ids += segment(text, generated[rid])
        return ids + [SOH, *text_ids(turn.text), *self.cfg.end_token_ids]

    def ceilings(self) -> dict[str, float]:
        """The unbounded-cache prefix hit rate over the prompts in trace order, every page of a finished request
        indexed (prompt and generated codes but the last, which is sampled and never fed, as M*'s KV resource does);
        a turn's generated codes are stood in for by ids drawn from its request id (equal exactly where the real ones
        are: the same turn's codes)."""
        stand_in = {r.rid: [CODE0 + int(x) for x in np.random.default_rng(
            xxhash.xxh64_intdigest(r.rid.encode())).integers(0, CODEBOOK, self.codes_per_request)]
            for r in self.made.requests}
        from mmcache import Fingerprint
        shadow = ShadowIndex(Fingerprint(model=self.made.fingerprint, page_size=self.page_size))
        for req in trace_order(self.requests()):
            shadow.admit(req.rid, np.asarray(self.prompt(req, stand_in), dtype=np.int32))
            shadow.finish(req.rid, np.asarray(stand_in[req.rid][:-1], dtype=np.int32))
        return {"prefix": prefix_ceiling(shadow)}
