"""Cached speaker embedding for one-reference voice cloning: a reference WAV in, one embedding [D] out.

Front end: torchaudio's Kaldi-compatible fbank (``torchaudio.compliance.kaldi.fbank``: 80 mel bins, 25 ms / 10 ms
frames, povey window, no dither) on 16 kHz mono, minus its mean over time; the front end CosyVoice feeds CAM++ and
most Kaldi-lineage x-vector models use. Encoder: ``SpeakerEncoder``, an x-vector TDNN (Snyder et al., 2018):
frame-level dilated 1-D convolutions, statistics pooling (mean and standard deviation over time), one affine
segment layer whose output is the embedding.

Weights folder (``save_pretrained`` / ``from_pretrained``): ``config.json`` (``SpeakerEncoderConfig`` fields) and
``model.safetensors`` with, for frame layer i of ``len(channels)``:

- ``frames.{i}.conv.weight`` [channels[i], channels[i-1] (num_mel_bins for i=0), kernel_sizes[i]], ``.conv.bias``
  [channels[i]]: ``Conv1d`` with dilation ``dilations[i]``, no padding; then ReLU, then
- ``frames.{i}.norm.{weight,bias,running_mean,running_var,num_batches_tracked}``: ``BatchNorm1d(channels[i])``;
- ``segment.weight`` [embedding_dim, 2 * channels[-1]], ``segment.bias`` [embedding_dim] over [mean ‖ std].

Loading is strict: a missing, extra or mis-shaped tensor fails. A plain x-vector TDNN with this Conv -> ReLU -> BN
order converts by renaming its keys. CAM++ (densely connected TDNN with context-aware masking) and ECAPA-TDNN
(SE-Res2Net blocks, attentive statistics pooling) are different networks: their weights do not fit this layout and
need their own module; the cache wrapper (``CachedSpeakerEncoder``) takes any module with the same ``config``,
``features`` and ``forward`` contract.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from encoders.audio import CachedWavEncoder
from mmcache.encoder_store import EncoderStore
from mmcache.errors import InvalidMedia
from mmcache.extras import import_torchaudio

kaldi = import_torchaudio("compliance.kaldi")

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


@dataclasses.dataclass(frozen=True)
class SpeakerEncoderConfig:
    """Front end (``sample_rate`` .. ``frame_shift_ms``) and network shape; defaults are the Kaldi x-vector's
    frame layers on 80-bin fbank with a 192-dim embedding (CAM++'s size)."""

    sample_rate: int = 16000
    num_mel_bins: int = 80
    frame_length_ms: float = 25.0
    frame_shift_ms: float = 10.0
    channels: tuple[int, ...] = (512, 512, 512, 512, 1500)
    kernel_sizes: tuple[int, ...] = (5, 3, 3, 1, 1)
    dilations: tuple[int, ...] = (1, 2, 3, 1, 1)
    embedding_dim: int = 192

    def __post_init__(self):
        for name in ("channels", "kernel_sizes", "dilations"):
            object.__setattr__(self, name, tuple(getattr(self, name)))  # JSON gives lists
        if not len(self.channels) == len(self.kernel_sizes) == len(self.dilations) > 0:
            raise ValueError(f"channels, kernel_sizes and dilations must have one equal, non-zero length: {self}")

    @property
    def fbank(self) -> dict:
        """Keyword arguments of ``kaldi.fbank``; the others keep torchaudio's Kaldi defaults (povey window,
        pre-emphasis 0.97, DC removal, snip_edges), as CosyVoice calls it."""
        return {"num_mel_bins": self.num_mel_bins, "frame_length": self.frame_length_ms,
                "frame_shift": self.frame_shift_ms, "dither": 0.0, "sample_frequency": float(self.sample_rate)}


class TDNNLayer(nn.Module):
    """One frame-level layer: dilated Conv1d (no padding: the output loses ``dilation * (kernel - 1)`` frames),
    ReLU, BatchNorm1d."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation)
        self.norm = nn.BatchNorm1d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.conv(x)))


class SpeakerEncoder(nn.Module):
    """x-vector speaker encoder: ``features(waveform)`` [T, num_mel_bins] -> ``forward`` [B, T, F] -> [B, D]."""

    def __init__(self, config: SpeakerEncoderConfig):
        super().__init__()
        self.config = config
        dims = (config.num_mel_bins, *config.channels)
        self.frames = nn.Sequential(*(TDNNLayer(i, o, k, d) for i, o, k, d in
                                      zip(dims, config.channels, config.kernel_sizes, config.dilations)))
        self.segment = nn.Linear(2 * config.channels[-1], config.embedding_dim)

    @property
    def min_frames(self) -> int:
        """Fewest fbank frames the frame layers accept: their receptive field."""
        return 1 + sum(d * (k - 1) for k, d in zip(self.config.kernel_sizes, self.config.dilations))

    def features(self, mono: torch.Tensor) -> torch.Tensor:
        """Mean-normalised Kaldi fbank [T, num_mel_bins] of float32 [1, samples] at ``config.sample_rate``;
        InvalidMedia when too short for ``min_frames``."""
        c = self.config
        # frame sizes in samples exactly as kaldi.fbank rounds them
        window, shift = (int(c.sample_rate * ms * 0.001) for ms in (c.frame_length_ms, c.frame_shift_ms))
        if mono.shape[-1] < window + (self.min_frames - 1) * shift:
            raise InvalidMedia(f"reference audio of {mono.shape[-1]} samples is shorter than the speaker encoder's "
                               f"{self.min_frames} frames of {c.frame_shift_ms} ms")
        feats = kaldi.fbank(mono, **c.fbank)
        return feats - feats.mean(0, keepdim=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        h = self.frames(features.transpose(1, 2))  # [B, C, T']
        var, mean = torch.var_mean(h, dim=-1, correction=0)
        return self.segment(torch.cat([mean, var.clamp_min(1e-5).sqrt()], dim=-1))  # the floor keeps std finite

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_NAME).write_text(json.dumps(dataclasses.asdict(self.config), indent=2))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, folder / WEIGHTS_NAME)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> SpeakerEncoder:
        """The model saved in ``folder``, in eval mode on the CPU; strict about the weight layout."""
        folder = Path(folder)
        model = cls(SpeakerEncoderConfig(**json.loads((folder / CONFIG_NAME).read_text())))
        model.load_state_dict(load_file(folder / WEIGHTS_NAME), strict=True)
        return model.eval()


class CachedSpeakerEncoder(CachedWavEncoder):
    """``speaker(wav) -> embedding [embedding_dim]`` in the model's dtype, keyed by the digest of the reference WAV
    as sent under modality "speaker". The digest params are the fbank settings, mean removal, resampler and
    downmix; the fingerprint covers the weights and the whole config."""

    modality = "speaker"

    def __init__(self, model: SpeakerEncoder, store: EncoderStore | None, *, fingerprint: str | None = None,
                 salt: bytes = b""):
        c = model.config
        super().__init__(model, store, {"fbank": c.fbank, "mean_norm": True}, c.sample_rate,
                         fingerprint=fingerprint, salt=salt)
        self.output_shape = (c.embedding_dim,)

    def features(self, mono: torch.Tensor) -> torch.Tensor:
        return self.module.features(mono)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        return self.module(features[None].to(self.device, self.dtype))[0]
