"""Decoders for the encoder wrappers: they turn user media into pixels, samples or frames, or raise InvalidMedia.

Digesting never calls these; a corrupt file still has a digest, and fails here, at the encoder, with a clear message.
"""

from __future__ import annotations

import dataclasses
import io
import os
import struct
import wave

import numpy as np

from digests.errors import InvalidMedia

_PIL_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error)


def _source(data, what: str):
    """A path or a binary file object for ``data`` (bytes-like, str / os.PathLike, or an open binary file)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return io.BytesIO(data)
    if isinstance(data, (str, os.PathLike)):
        if not os.path.isfile(data):
            raise InvalidMedia(f"no such {what} file: {os.fspath(data)!r}")
        return os.fspath(data)
    if hasattr(data, "read"):
        return data
    raise InvalidMedia(f"cannot decode {type(data).__qualname__} as {what}: expected bytes, a path or a binary file")


def open_image(data):
    """A fully loaded PIL image (mode as stored, no conversion); InvalidMedia if it is missing, corrupt or truncated."""
    from PIL import Image

    src = _source(data, "image")
    try:
        img = Image.open(src)
        img.load()  # Image.open only reads the header; truncation and bad data surface here
    except (Image.DecompressionBombError, *_PIL_ERRORS) as e:
        raise InvalidMedia(f"cannot decode image{_name(data)}: {e}") from e
    return img


def load_wav(data):
    """``(waveform, sample_rate)`` of a PCM WAV (8/16/24/32-bit): a float32 torch tensor [channels, samples] in
    [-1, 1). InvalidMedia if the file is missing, not PCM WAV, truncated, or its format chunk is inconsistent (bits
    per sample not 8/16/24/32, block_align != channels * bytes per sample, byte rate != rate * block_align): the
    stdlib reader trusts the bits and would read such data as other frames of noise."""
    import torch

    src = _source(data, "WAV")
    f = open(src, "rb") if isinstance(src, str) else src
    try:
        _check_format(f, data)
        with wave.open(f, "rb") as w:
            channels, width, rate, frames = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            raw = w.readframes(frames)
    except (wave.Error, EOFError, struct.error, ValueError) as e:
        raise InvalidMedia(f"cannot decode WAV{_name(data)}: {e}") from e
    finally:
        if f is not src:
            f.close()
    if channels < 1 or width not in (1, 2, 3, 4):
        raise InvalidMedia(f"unsupported WAV{_name(data)}: {channels} channel(s), {8 * width}-bit samples")
    if len(raw) != frames * channels * width:  # wave returns what is there, silently, when the data is cut short
        raise InvalidMedia(f"truncated WAV{_name(data)}: {len(raw)} of {frames * channels * width} data bytes")
    if width == 1:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128) / 128
    elif width == 3:  # no int24 dtype: place each sample in the top 3 bytes of an int32, then scale as 32-bit
        padded = np.zeros((len(raw) // 3, 4), np.uint8)
        padded[:, 1:] = np.frombuffer(raw, np.uint8).reshape(-1, 3)
        x = padded.view("<i4")[:, 0] / np.float32(2**31)
    else:
        x = np.frombuffer(raw, f"<i{width}") / np.float32(2 ** (8 * width - 1))
    return torch.from_numpy(np.ascontiguousarray(x.astype(np.float32).reshape(-1, channels).T)), rate


def _check_format(f, data) -> None:
    """InvalidMedia unless the RIFF ``fmt `` chunk of the open binary file ``f`` is self-consistent PCM; the file
    position is restored. Files that are not RIFF/WAVE at all are left to ``wave`` to refuse."""
    start = f.tell()
    try:
        head = f.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return
        while len(chunk := f.read(8)) == 8:
            cid, size = chunk[:4], struct.unpack("<I", chunk[4:])[0]
            if cid != b"fmt ":
                f.seek(size + (size & 1), os.SEEK_CUR)
                continue
            fmt = f.read(size)
            if len(fmt) < 16:
                raise InvalidMedia(f"bad WAV{_name(data)}: a format chunk of {len(fmt)} bytes")
            tag, channels, rate, byte_rate, block_align, bits = struct.unpack("<HHIIHH", fmt[:16])
            problems = []
            if bits not in (8, 16, 24, 32):
                problems.append(f"{bits} bits per sample (8, 16, 24 or 32 expected)")
            if channels < 1 or rate < 1:
                problems.append(f"{channels} channel(s) at {rate} Hz")
            if block_align != channels * (bits // 8 or 1):
                problems.append(f"block_align {block_align} for {channels} channel(s) of {bits} bits")
            if byte_rate != rate * block_align:
                problems.append(f"byte rate {byte_rate} for {rate} Hz x block_align {block_align}")
            if problems:
                raise InvalidMedia(f"inconsistent WAV header{_name(data)}: " + "; ".join(problems))
            return
    finally:
        f.seek(start)


@dataclasses.dataclass(frozen=True)
class FrameSampling:
    """Which frames of a clip an encoder sees: ``num_frames`` of them, evenly spaced over the whole clip, or with
    ``fps`` the first ``num_frames`` at that rate from the start (frame k at the first frame shown at or after k/fps
    seconds). Part of a video's digest params, so two samplings of one file never share an entry."""

    num_frames: int
    fps: float | None = None

    def __post_init__(self):
        if isinstance(self.num_frames, bool) or not isinstance(self.num_frames, int) or self.num_frames < 1:
            raise InvalidMedia(f"num_frames must be a positive integer, got {self.num_frames!r}")
        if self.fps is not None and not self.fps > 0:
            raise InvalidMedia(f"fps must be positive, got {self.fps!r}")

    def indices(self, times: list[float]) -> list[int]:
        """Indices into a clip whose frames are shown at ``times`` (seconds, increasing); InvalidMedia when the clip
        has fewer frames, or is shorter, than the sampling asks for."""
        n = len(times)
        if self.fps is None:
            if self.num_frames > n:
                raise InvalidMedia(f"{self.num_frames} frames asked for, the clip has {n}")
            return [round(k * (n - 1) / max(self.num_frames - 1, 1)) for k in range(self.num_frames)]
        start, picked, j = times[0] if times else 0.0, [], 0
        for k in range(self.num_frames):
            while j < n and times[j] - start < k / self.fps - 1e-9:
                j += 1
            if j == n:
                raise InvalidMedia(f"{self.num_frames} frames at {self.fps} fps asked for, the clip has {n} frames "
                                   f"over {times[-1] - start if times else 0:.3f} s")
            picked.append(j)
        return picked


def load_video(data, sampling: FrameSampling):
    """The sampled frames of a video file (bytes, path or binary file) as uint8 RGB [num_frames, H, W, 3], decoded
    with PyAV. InvalidMedia for a missing file, data no demuxer reads, a file without a video stream, a stream its
    container's codec cannot decode (container and codec disagree), a clip that ends before the frames its container
    declares (truncated), or a sampling beyond the clip. Every frame is decoded: truncation shows only at the end."""
    import av

    src = _source(data, "video")
    try:
        with av.open(src, "r") as container:
            if not container.streams.video:
                raise InvalidMedia(f"no video stream in{_name(data) or ' the'} file")
            stream = container.streams.video[0]
            codec, declared = stream.codec_context.name, _declared_frames(container, stream)
            try:
                frames = [(float(f.time or 0.0), f) for f in container.decode(stream)]
            except av.error.FFmpegError as e:
                raise InvalidMedia(f"the {codec} stream of video{_name(data)} does not decode ({e}): truncated, or "
                                   f"its container and codec disagree") from e
            if not frames:
                raise InvalidMedia(f"video{_name(data)} has no decodable frame of its {codec} stream")
            if declared is not None and len(frames) < declared:
                raise InvalidMedia(f"truncated video{_name(data)}: {len(frames)} of the {declared} frames its "
                                   f"container declares")
            picked = sampling.indices([t for t, _ in frames])
            return np.stack([frames[i][1].to_ndarray(format="rgb24") for i in picked])
    except av.error.FFmpegError as e:
        raise InvalidMedia(f"cannot read video{_name(data)}: {e}") from e
    except IndexError as e:  # PyAV's open() of a container with no readable stream info
        raise InvalidMedia(f"cannot read video{_name(data)}: no stream information (truncated?)") from e


def _declared_frames(container, stream) -> int | None:
    """Frames the container says the stream has: its frame count, else its duration times its frame rate."""
    if stream.frames:
        return int(stream.frames)
    if container.duration and stream.average_rate:
        return round(container.duration / 1e6 * float(stream.average_rate))
    return None


def _name(data) -> str:
    return f" {os.fspath(data)!r}" if isinstance(data, (str, os.PathLike)) else ""
