"""vlm-chat's sessions as a metadata trace for the replica replay: several users per image, arriving over time.

Each item (a question with its images: MMMU-Pro's sample questions, vlm-chat's data) is asked about by
``users_per_item`` users. A session is vlm-chat's (``workloads.models.vlm_chat``, in the words of
``vlm_chat_turns``): the shared system prompt, a first user turn (the user's own line, then one of vlm-chat's
preambles, the question with its images, the options), and vlm-chat's two follow-ups, each re-sending the history,
images and replies included. The user's own line ("I am user u.") makes every user's pages their own past the system
prompt, so what users of one image share is the image: its encoder output, and nothing of its KV (it sits behind
each user's text). Sessions start in a seeded random order as a Poisson process of ``sessions_per_s``; a session's
next turn comes ``think_s`` (exponential mean) after the previous one would have ended (``text_trace.turn_calls``).

No model: an image is ``image_tokens`` placeholder rows (LLaVA-1.5 at 336 px: (336 / 14)^2 = 576) named by the
digest of its file's bytes, and its encoder output is ``feature_bytes`` (576 rows x 4096 x 2 bytes: LLaVA-1.5-7B's
projected features in bf16). A reply is ``output_tokens`` stand-in ids, re-sent verbatim by the next turn (text
replies are), so its pages are indexed and matched as an engine's would be; which ids it holds changes no match,
because every prompt is the user's own from their first line on.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import numpy as np

import digests
from mmcache.errors import InvalidMedia, TraceError
from workloads.traces.mmmu import Part, load_mmmu
from workloads.traces.swe_agent import Trajectory
from workloads.traces.text_trace import MediaItem, TextTrace, turn_calls
from workloads.traces.tokenizer import load_tokenizer
from workloads.traces.vlm_chat_turns import FOLLOW_UPS, PREAMBLES, SYSTEM

MMMU_QUESTIONS = "mmmu/mmmu_pro_tool_sample_questions.jsonl"  # vlm-chat's data, under the shared data folder
IMAGE_PLACEHOLDER = 0
_DIGEST_PARAMS = {"replay": "llava-1.5", "image_size": 336}  # stands for the processor's canonical parameters


@dataclasses.dataclass(frozen=True)
class ImageChats:
    users_per_item: int = 8
    sessions_per_s: float = 2.0
    think_s: float = 6.0                       # vlm-chat's gap between turns
    image_tokens: int = 576
    feature_bytes: int = 576 * 4096 * 2
    output_tokens: tuple[int, int] = (50, 300)
    seed: int = 0

    def trace(self, items: Sequence[Sequence[Part]], tokenizer, source: str, limit: int | None = None) -> TextTrace:
        """The sessions of ``items`` (each a question's parts: text, image paths or bytes), the first ``limit`` to
        start (all by default); ``TraceError`` naming an image that cannot be read."""
        rng = np.random.default_rng(self.seed)
        tok = lambda text: np.asarray(tokenizer.encode([text])[0], dtype=np.int32)  # noqa: E731
        bos = np.array([tokenizer.bos_id()], dtype=np.int32)
        system, close = tok(f"[system]\n{SYSTEM}\n"), tok("\n[assistant]\n")
        follow_ups = [tok(f"\n[user]\n{q}\n[assistant]\n") for q in FOLLOW_UPS]
        questions = [self._question(parts, tok) for parts in items]
        pairs = [(i, u) for i in range(len(items)) for u in range(self.users_per_item)]
        order = rng.permutation(len(pairs))[:limit]
        starts = np.cumsum(rng.exponential(1.0 / self.sessions_per_s, len(order)))
        sessions = []
        for start, k in zip(starts, order):
            i, u = pairs[k]
            tokens, media = questions[i]
            opening = tok(f"[user]\nI am user {u}. {PREAMBLES[u % len(PREAMBLES)]}\n")
            first = np.concatenate([opening, tokens, close])
            shifted = tuple(dataclasses.replace(m, offset=m.offset + opening.size) for m in media)
            messages = [system, first]
            for follow in follow_ups:
                messages += [self._reply(rng), follow]
            messages.append(self._reply(rng))
            lengths, sent = [], bos.size
            for t in range(1 + len(follow_ups)):
                sent += messages[2 * t].size + messages[2 * t + 1].size
                lengths.append((sent, messages[2 * t + 2].size))
            sessions.append(Trajectory(f"i{i}u{u}", bos, messages, turn_calls(float(start), lengths, self.think_s,
                                                                               rng), {1: shifted}))
        return TextTrace(f"{source} as image chats (users_per_item={self.users_per_item}, sessions_per_s="
                         f"{self.sessions_per_s:g}, seed={self.seed})", "image-chats", sessions)

    def _question(self, parts: Sequence[Part], tok) -> tuple[np.ndarray, tuple[MediaItem, ...]]:
        """A question's token ids, each image a run of placeholders, and its images as media items."""
        pieces, media, n = [], [], 0
        for part in parts:
            if isinstance(part, str):
                pieces.append(tok(part))
            else:
                try:
                    digest = bytes(digests.image(part, _DIGEST_PARAMS))
                except (InvalidMedia, OSError) as e:
                    raise TraceError(part if isinstance(part, Path) else "<image bytes>", None,
                                     f"cannot read the image: {e}") from None
                media.append(MediaItem(n, self.image_tokens, digest, "image", self.feature_bytes))
                pieces.append(np.full(self.image_tokens, IMAGE_PLACEHOLDER, dtype=np.int32))
            n += pieces[-1].size
        return np.concatenate(pieces), tuple(media)

    def _reply(self, rng: np.random.Generator) -> np.ndarray:
        return np.zeros(int(rng.integers(self.output_tokens[0], self.output_tokens[1] + 1)), dtype=np.int32)


def load_image_chats(data: str | Path, *, limit: int | None = None, seed: int = 0) -> TextTrace:
    """The registry's replica-replay trace of ``vlm-chat``: ``ImageChats`` over the MMMU-Pro questions under the
    shared data folder ``data``, text tokenized by the Mistral SentencePiece model (what vlm-chat's tiny LLaVA
    uses)."""
    path = Path(data) / MMMU_QUESTIONS
    return ImageChats(seed=seed).trace(load_mmmu(path), load_tokenizer(), str(path), limit)
