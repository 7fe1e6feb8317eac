"""Short real video clips made from still images: a slow pan across each image, encoded once with a real codec.

No clip ships with the project (shared data may not be copied in), so video workloads make theirs: ``pan_clip``
crops a ``px`` x ``px`` window that slides across the image (resized so its short side is ``1.5 px``) over
``frames`` frames and encodes them with PyAV (MPEG-4 Part 2 in an MP4 container by default, ``fps`` frames per
second). ``clip_files`` writes each image's clip once into a folder and reuses it after, so a clip's bytes, and
with them its digest, are stable from run to run. Invariant: the same image and settings give the same bytes.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
import xxhash

FRAMES, FPS, PX, CODEC, CONTAINER = 8, 8, 64, "mpeg4", "mp4"


def encode_frames(frames: np.ndarray, *, fps: int = FPS, codec: str = CODEC, container: str = CONTAINER) -> bytes:
    """The file bytes of uint8 RGB ``frames`` [T, H, W, 3] (H and W even) encoded by PyAV as ``codec`` in
    ``container``."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def pan_frames(image, *, frames: int = FRAMES, px: int = PX) -> np.ndarray:
    """uint8 RGB [frames, px, px, 3]: a ``px`` window sliding along the long side of ``image`` (a PIL image or
    image bytes), resized first so its short side is ``1.5 px``."""
    from digests import open_image

    img = (open_image(image) if isinstance(image, (bytes, bytearray)) else image).convert("RGB")
    short = int(1.5 * px)
    w, h = img.size
    scale = short / min(w, h)
    img = img.resize((max(short, round(w * scale)), max(short, round(h * scale))))
    pixels = np.asarray(img)
    H, W = pixels.shape[:2]
    out = []
    for k in range(frames):
        t = k / max(frames - 1, 1)
        y, x = round(t * (H - px)), round(t * (W - px))
        out.append(pixels[y:y + px, x:x + px])
    return np.stack(out)


def pan_clip(image, *, frames: int = FRAMES, px: int = PX, fps: int = FPS, codec: str = CODEC,
             container: str = CONTAINER) -> bytes:
    """The clip of ``pan_frames(image)`` as file bytes."""
    return encode_frames(pan_frames(image, frames=frames, px=px), fps=fps, codec=codec, container=container)


def clip_files(images: Sequence[bytes], folder: str | Path, **settings) -> list[Path]:
    """One clip file per image under ``folder``, named by a hash of the image and ``settings``; written once (to a
    temporary name, then renamed into place) and reused after."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for image in images:
        name = xxhash.xxh64_hexdigest(bytes(image) + repr(sorted(settings.items())).encode())
        path = folder / f"pan-{name}.{settings.get('container', CONTAINER)}"
        if not path.is_file():
            with tempfile.NamedTemporaryFile(dir=folder, delete=False) as tmp:
                tmp.write(pan_clip(image, **settings))
            Path(tmp.name).rename(path)
        paths.append(path)
    return paths
