"""Cached Mimi codec encoder: a reference WAV in, its codec codes [frames, num_codebooks] out, the codec run once per
(file, resampling, weights). CSM (``mmcache.hf.csm``) prompts carry a voice reference as these codes."""

from __future__ import annotations

import torch

from encoders.audio import CachedWavEncoder
from mmcache.encoder_store import EncoderStore
from mmcache.errors import EncoderOutputError


class CachedCodecEncoder(CachedWavEncoder):
    """A reference WAV -> Mimi codes [frames, num_codebooks] (int64), keyed under modality "audio".

    The codec takes the raw mono waveform at its sampling rate as ``[1, 1, samples]`` (what CSM's feature extractor
    hands it), so the digest params are the codec's rate and codebook count (plus the base's resampler and downmix).
    Invariant: the output has exactly ``frames(samples)`` rows, so a prompt's layout follows from the WAV alone.
    """

    modality = "audio"

    def __init__(self, codec, store: EncoderStore | None, *, fingerprint: str | None = None, salt: bytes = b""):
        c = codec.config
        self.num_codebooks = c.num_quantizers
        super().__init__(codec, store, {"codec": "mimi", "input": "waveform", "num_quantizers": c.num_quantizers},
                         c.sampling_rate, fingerprint=fingerprint, salt=salt)

    def frames(self, samples: int) -> int:
        """Codec frames of ``samples`` mono samples at the codec's rate."""
        return int(self.module.get_encoded_length(torch.tensor(samples)))

    def reference_frames(self, data) -> int:
        """Frames the codes of a WAV (read media) will have (decodes and resamples, runs no codec)."""
        waveform, rate = data if isinstance(data, tuple) else self.decode(data)
        return self.frames(self.mono(waveform, rate).shape[-1])

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
