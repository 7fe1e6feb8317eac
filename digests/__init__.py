"""Media digests: 128-bit names for images, audio, video and prompts, from raw bytes plus canonical parameters.

``image``, ``audio``, ``video`` and ``prompt`` return a ``Digest``; ``open_image``, ``load_wav`` and ``load_video``
(frames by a ``FrameSampling``) decode for the encoders. Decoded inputs (a PIL image, an array, a waveform) are
digested from their pixels or samples with a ``decoded`` marker, so they never equal the digest of a file.
"""

from digests.canonical import Canonical, canonical
from digests.decode import FrameSampling, load_video, load_wav, open_image
from digests.digest import ALGORITHMS, DEFAULT, Digest
from digests.media import audio, image, prompt, video

__all__ = ["ALGORITHMS", "DEFAULT", "Canonical", "Digest", "FrameSampling", "audio", "canonical", "image",
           "load_video", "load_wav", "open_image", "prompt", "video"]
