"""Video clips the video tests make themselves (``test_video.py``, ``test_workload_video.py``): seeded frames, a
clip of them in MP4 and in Matroska, and one bad clip per kind of bad input."""

import numpy as np

from workloads.traces.clips import encode_frames


def frames(n: int = 8, px: int = 32) -> np.ndarray:
    rng = np.random.default_rng(n)
    return rng.integers(0, 256, (n, px, px, 3), dtype=np.uint8)


CLIP = encode_frames(frames())
MKV = encode_frames(frames(), container="matroska")


def bad_clips() -> dict[str, bytes]:
    """One clip per kind of bad input, each with the words its error must contain."""
    return {"Invalid data": b"this is not a video, only text" * 8,
            "truncated": MKV[:int(len(MKV) * 0.6)],
            "container and codec disagree": MKV.replace(b"V_MPEG4/ISO/ASP", b"V_MPEG4/ISO/AVC"),
            "9 frames asked for, the clip has 8": CLIP}
