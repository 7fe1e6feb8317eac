"""voice-clone's requests as a metadata trace for the replica replay: many users cloning a few reference voices.

Each of ``users`` users picks one reference voice (uniformly; the references and their transcripts are
Seed-TTS-Eval's, voice-clone's data) and holds a voice session of ``turns`` turns, laid out by CSM's template
(``mmcache.hf.csm``, what voice-clone serves): the reference line (its transcript, then one row per Mimi frame of the
reference audio), then each earlier turn's line with the frames it generated, then the text to say. What the users of
one voice share is that reference line: its page-aligned KV (it opens every prompt) and the codec's codes of the
reference (the encoder output, ``frames x codebooks`` int64). A turn's text is a sentence drawn by voice-clone's own
generator (``voice_clone_turns.sentence``), so two turns share nothing past the reference. Users arrive as a Poisson
process of ``users_per_s``; a turn comes ``think_s`` (exponential mean) after the previous one would have ended
(``text_trace.turn_calls``).

No model: frames of a reference are its duration at Mimi's 12.5 frames/s; audio rows are placeholder ids; the
reference is named by the digest of its WAV's bytes; generated frames sent back by a later turn are named by one
stand-in digest per generating turn (as voice-clone's ceiling does) and need no encoder. Generated frames are not
the ids a page could be named by at generation, so outputs are never indexed (``Trajectory.outputs_resent``).
"""

from __future__ import annotations

import dataclasses
import io
import math
import wave
from pathlib import Path
from typing import Sequence

import numpy as np

import digests
from mmcache.errors import InvalidMedia, TraceError
from workloads.traces.seedtts import SEEDTTS, load_seedtts
from workloads.traces.swe_agent import Trajectory
from workloads.traces.text_trace import MediaItem, TextTrace, turn_calls
from workloads.traces.tokenizer import load_tokenizer
from workloads.traces.voice_clone_turns import AUDIO_CHUNK_FRAMES, sentence

FRAMES_PER_S = 12.5                      # Mimi
AUDIO_TOKEN, AUDIO_EOS = 1 << 20, (1 << 20) + 1  # placeholder ids of audio rows, outside any text vocabulary
_DIGEST_PARAMS = {"replay": "mimi", "num_quantizers": 32}  # stands for the codec's canonical parameters


@dataclasses.dataclass(frozen=True)
class Voice:
    """A reference voice: its WAV (path or bytes) and transcript."""

    wav: Path | bytes
    transcript: str


def reference_frames(wav: Path | bytes) -> int:
    """Mimi frames of a reference WAV (its duration at 12.5 frames/s); ``TraceError`` for one that cannot be read."""
    try:
        with wave.open(str(wav) if isinstance(wav, Path) else io.BytesIO(wav), "rb") as w:
            return max(1, math.ceil(w.getnframes() / w.getframerate() * FRAMES_PER_S))
    except (OSError, EOFError, wave.Error, ZeroDivisionError) as e:
        raise TraceError(wav if isinstance(wav, Path) else "<WAV bytes>", None, f"not a readable WAV: {e}") from None


@dataclasses.dataclass(frozen=True)
class VoiceSessions:
    users: int = 200
    turns: tuple[int, int] = (1, 4)
    users_per_s: float = 2.0
    think_s: float = 3.0
    frames: tuple[int, int] = (40, 100)  # frames generated per turn: 3.2-8 s of speech
    codebooks: int = 32                  # CSM-1B's Mimi codebooks: a reference's codes are frames x 32 int64
    seed: int = 0

    def trace(self, voices: Sequence[Voice], tokenizer, source: str, limit: int | None = None) -> TextTrace:
        """The sessions of the first ``limit`` users (all by default) over ``voices``."""
        from mmcache.hf.csm import Template
        if not voices:
            raise TraceError(source, None, "no reference voices")
        rng = np.random.default_rng(self.seed)
        template = Template(lambda s: tokenizer.encode([s])[0], tokenizer.bos_id(), tokenizer.eos_id(), AUDIO_TOKEN,
                            AUDIO_EOS)
        refs = []
        for v in voices:
            n = reference_frames(v.wav)
            ids, (offset,) = template.layout([(v.transcript, n)])
            item = MediaItem(offset, n, bytes(digests.audio(v.wav, _DIGEST_PARAMS)), "audio", n * self.codebooks * 8)
            refs.append((np.asarray(ids, dtype=np.int32), item))
        span = lambda lo_hi: int(rng.integers(lo_hi[0], lo_hi[1] + 1))  # noqa: E731
        sessions, start = [], 0.0
        for u in range(self.users if limit is None else min(limit, self.users)):
            start += float(rng.exponential(1.0 / self.users_per_s))
            v = int(rng.integers(len(refs)))
            ref, item = refs[v]
            name = f"v{v}u{u}"
            messages, media, lengths, sent = [ref], {0: (item,)}, [], ref.size
            for t in range(span(self.turns)):
                line = np.asarray(template.layout([(sentence(rng), None)])[0], dtype=np.int32)
                frames = span(self.frames)
                sent += line.size
                lengths.append((sent, frames))
                messages += [line, np.array([AUDIO_TOKEN] * frames + [AUDIO_EOS], dtype=np.int32)]
                media[len(messages) - 1] = (MediaItem(0, frames, bytes(digests.prompt([], {"generated_by":
                                                                                             f"{name}#{t}"}))),)
                sent += frames + 1
            sessions.append(Trajectory(name, np.zeros(0, dtype=np.int32), messages,
                                       turn_calls(start, lengths, self.think_s, rng), media, outputs_resent=False))
        return TextTrace(f"{source} as voice sessions (users={self.users}, voices={len(voices)}, seed={self.seed})",
                         "voice-sessions", sessions, first_audio_tokens=AUDIO_CHUNK_FRAMES)


def load_voice_sessions(data: str | Path, *, limit: int | None = None, seed: int = 0) -> TextTrace:
    """The registry's replica-replay trace of ``voice-clone``: ``VoiceSessions`` over the distinct references of the
    Seed-TTS-Eval rows under the shared data folder ``data`` (``seedtts.load_seedtts`` reads them), text tokenized by
    the Mistral SentencePiece model (what voice-clone's tiny CSM uses)."""
    meta = Path(data) / SEEDTTS
    voices = {}
    for row in load_seedtts(meta):
        voices.setdefault(row.wav, Voice(row.wav, row.transcript))
    try:
        return VoiceSessions(seed=seed).trace(list(voices.values()), load_tokenizer(), str(meta), limit)
    except InvalidMedia as e:
        raise TraceError(meta, None, str(e)) from None
