"""Cached audio encoders: a WAV in, the encoder's output out, computed once per (file, preprocessing, weights).

``CachedWavEncoder`` is the shared pipeline, ``CachedAudioEncoder`` its Whisper-family instance (log-mel features ->
``WhisperEncoder.last_hidden_state``). ``encoders.speaker`` builds the speaker-embedding instance on the same base.

Key of one input: ``EncoderKey(digests.audio(input as sent, params), fingerprint, modality, salt)``. ``params`` (the
canonical feature extractor, resampler and downmix) and ``fingerprint`` (``module_fingerprint``: weights, config,
attention backend, dtype, device type) are computed once at construction, so a hit costs reading the input (paths), one
pass of the hash over its bytes, one lookup and one gather: no decode, no resample, no features, no encoder forward.
"""

from __future__ import annotations

import torch
from torch import nn

import digests
from encoders.base import CachedEncoder
from mmcache.encoder_store import EncoderStore
from mmcache.errors import EncoderOutputError, InvalidMedia
from mmcache.extras import import_torchaudio
from mmcache.module_fingerprint import module_fingerprint

torchaudio = import_torchaudio()

# Passed to torchaudio.functional.resample verbatim and digested with the features: they are what runs.
RESAMPLE = {"lowpass_filter_width": 6, "rolloff": 0.99, "resampling_method": "sinc_interp_hann"}
DOWNMIX = "mean"  # channels are averaged before resampling


class CachedWavEncoder(CachedEncoder):
    """``encoder(wav)``: the output of ``encode(features(mono(decode(wav))))``, through ``store`` when given.

    ``wav`` is WAV bytes, a path to a WAV file, or ``(waveform, sample_rate)`` with float samples in [-1, 1) shaped
    [samples] or [channels, samples]. The digest is of the input as sent: a file and its bytes share an entry, a
    decoded waveform never shares one with a file. A path is read once and its bytes are both digested and decoded,
    so a file rewritten in between can never store one recording's output under another's digest. ``store=None``
    runs the pipeline every call (the uncached baseline). Invariants: a hit equals the miss that stored it bit for
    bit; an input that fails to decode raises ``InvalidMedia`` and an output unlike ``output_shape``/``dtype`` raises
    ``EncoderOutputError``, both before the store sees anything. Outputs come back on the module's device whether
    computed or gathered.

    Subclasses set ``modality``, ``output_shape`` and the digest ``params`` and define ``features`` and ``encode``.
    ``decode``, ``mono``, ``features`` and ``encode`` are the stages a hit skips; each is an overridable method.
    """

    output_shape: tuple[int, ...]
    media_kind = "WAV"

    def __init__(self, module: nn.Module, store: EncoderStore | None, params, rate: int, *,
                 fingerprint: str | None = None, salt: bytes = b""):
        self.module = module.eval()
        self.rate = int(rate)
        self.params = digests.canonical({"features": params, "resample": RESAMPLE, "downmix": DOWNMIX})
        p = next(module.parameters())
        super().__init__(store, module_fingerprint(module) if fingerprint is None else fingerprint, salt=salt,
                         device=p.device, dtype=p.dtype)

    def read(self, wav):
        """``wav`` as immutable bytes (a path read once) or the ``(waveform, sample_rate)`` pair; InvalidMedia
        otherwise."""
        return wav if isinstance(wav, tuple) and len(wav) == 2 else super().read(wav)

    def digest(self, data) -> digests.Digest:
        return digests.audio(data, self.params)

    def compute(self, data) -> torch.Tensor:
        """The uncached pipeline on WAV bytes or ``(waveform, rate)``: decode, downmix + resample, features, encoder,
        output check."""
        waveform, rate = data if isinstance(data, tuple) else self.decode(data)
        features = self.features(self.mono(waveform, rate))
        with torch.inference_mode():
            out = self.encode(features)
        if tuple(out.shape) != self.output_shape or out.dtype != self.dtype:
            raise EncoderOutputError(f"{self.modality} encoder gave {tuple(out.shape)} {out.dtype}, expected "
                                     f"{self.output_shape} {self.dtype}")
        return out

    def decode(self, data: bytes) -> tuple[torch.Tensor, int]:
        """``(float32 [channels, samples], sample_rate)`` of WAV bytes; InvalidMedia if not PCM WAV or truncated."""
        return digests.load_wav(data)

    def mono(self, waveform, rate: int) -> torch.Tensor:
        """float32 [1, samples] at ``self.rate``: channels averaged, then resampled with ``RESAMPLE``."""
        x = torch.as_tensor(waveform)
        if not x.is_floating_point() or x.dim() not in (1, 2) or not x.numel() or int(rate) <= 0:
            raise InvalidMedia(f"a waveform must be non-empty float [samples] or [channels, samples] at a positive "
                               f"rate, got {x.dtype} {tuple(x.shape)} at {rate}")
        x = x.detach().to("cpu", torch.float32)
        x = x[None] if x.dim() == 1 else x
        x = x.mean(0, keepdim=True) if x.shape[0] > 1 else x
        return x if rate == self.rate else torchaudio.functional.resample(x, rate, self.rate, **RESAMPLE)

    def features(self, mono: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class CachedAudioEncoder(CachedWavEncoder):
    """The encoder of a Whisper-family model (``WhisperModel``, ``WhisperForConditionalGeneration`` or a bare
    ``WhisperEncoder``) on log-mel features from its ``WhisperFeatureExtractor``.

    Output: ``last_hidden_state`` [1, max_source_positions, d_model] in the model's dtype, exactly what the model's
    own encoder returns for the extractor's features (audio past ``chunk_length`` seconds is cut, shorter audio padded,
    as the extractor does). Keyed under modality "audio".
    """

    modality = "audio"

    def __init__(self, model: nn.Module, feature_extractor, store: EncoderStore | None, *,
                 fingerprint: str | None = None, salt: bytes = b""):
        encoder = model.get_encoder()
        config, fe = encoder.config, feature_extractor
        if fe.feature_size != config.num_mel_bins or fe.nb_max_frames != 2 * config.max_source_positions:
            raise ValueError(f"feature extractor gives {fe.feature_size} mel bins x {fe.nb_max_frames} frames; the "
                             f"encoder takes {config.num_mel_bins} x {2 * config.max_source_positions}")
        super().__init__(encoder, store, fe, fe.sampling_rate, fingerprint=fingerprint, salt=salt)
        self.feature_extractor = fe
        self.output_shape = (1, config.max_source_positions, config.d_model)

    def features(self, mono: torch.Tensor) -> torch.Tensor:
        """Log-mel ``input_features`` [1, num_mel_bins, 2 * max_source_positions] (float32, CPU)."""
        return self.feature_extractor(mono[0].numpy(), sampling_rate=self.rate, return_tensors="pt").input_features

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        return self.module(features.to(self.device, self.dtype)).last_hidden_state

