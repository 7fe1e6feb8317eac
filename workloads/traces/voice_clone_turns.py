"""What voice-clone's turns say and when their audio comes back: the generated sentences of its embedded default and
its voice sessions (``sentence``), and the Mimi frames per audio chunk (``AUDIO_CHUNK_FRAMES``: the frames a turn
generates before its first audio). The model workload (``workloads.models.voice_clone``) and its replica-replay
trace (``voice_sessions``) both lay out their turns by these."""

from __future__ import annotations

import numpy as np

AUDIO_CHUNK_FRAMES = 2          # Mimi frames per audio chunk: 160 ms at 12.5 frames/s
_WORDS = ("the", "a", "quiet", "river", "light", "morning", "voice", "carries", "over", "green", "hills", "we",
          "found", "seven", "small", "boats", "near", "old", "harbor", "wind", "turns", "slowly", "before", "rain",
          "every", "story", "begins", "with", "one", "clear", "sound", "and", "ends", "far", "away", "today")


def sentence(rng: np.random.Generator) -> str:
    """A transcript of 6 to 12 words from the embedded vocabulary."""
    words = rng.choice(_WORDS, int(rng.integers(6, 13)))
    return " ".join(words).capitalize() + "."
