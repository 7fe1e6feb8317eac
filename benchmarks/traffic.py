"""Long-running generated traffic, to judge eviction policies where a mean over a trace hides the worst window:
sessions that end, bursts that stop, encoder traffic that stops.

Each generator returns a ``TextTrace`` (``workloads.traces.text_trace``) of sessions of calls, every token drawn from
one ``numpy`` generator seeded with ``seed``, so a trace is a pure function of its parameters. Every session re-sends
its history (its previous prompt and output) and adds a turn, as chat and agent traffic does; a replay interleaves
the sessions (``Serving("round-robin", sessions=...)``: when a session ends, the next one takes its turn) and serves
each call as an engine does (``workloads.sizing.ordering``). ``bench_traffic.py`` replays them window by window.

- ``agent_sessions``: agents re-sending a growing history, a page a call, ending after 8-24 calls and replaced;
- ``ending_chats``: chats of 2-8 turns under one of four system prompts, that end;
- ``hot_prompts``: one call each, a hot system prompt (of eight, by a Zipf law) and a suffix of its own;
- ``burst``: ``ending_chats`` with a burst in the middle: four long prompts each sent 16 times, then never again;
- ``encoder_stop``: ``ending_chats`` whose first turn carries an image (one of a few hundred, by a Zipf law) for the
  first half of the sessions, text only after: KV pages and encoder outputs on one pool, the encoder traffic stopping
  midway (replay with ``encoders=EncoderPlace(kv_page_bytes=KV_PAGE_BYTES)``).
"""

from __future__ import annotations

import hashlib

import numpy as np

from workloads.traces.swe_agent import Trajectory
from workloads.traces.text_trace import CallInfo, MediaItem, TextTrace

PAGE = 16                           # tokens per page the generators are sized in
VOCAB = 32_000
IMAGE_TOKENS = 64                   # placeholder rows of an image (four pages)
IMAGE_BYTES = 64 * 4096 * 2         # its encoder output: 64 rows x 4096 x bf16
KV_PAGE_BYTES = PAGE * 16 * 1024    # a KV page of PAGE tokens at 16 KiB a token: an output takes two pages


class _Draw:
    """Token arrays and lengths from one seeded generator."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(1, VOCAB, size=n, dtype=np.int32)

    def pages(self, lo: int, hi: int) -> int:
        """A whole number of pages' tokens, from ``lo`` to ``hi`` pages."""
        return PAGE * int(self.rng.integers(lo, hi + 1))


def _session(name: str, messages: list[np.ndarray], media: dict | None = None) -> Trajectory:
    """A session of ``messages`` (system, then user and output alternating): call ``i`` sends everything before its
    output ``messages[2i + 2]``."""
    bos = np.zeros(1, dtype=np.int32)
    calls, sent = [], bos.size + messages[0].size
    for i in range(1, len(messages) - 1, 2):
        sent += messages[i].size
        calls.append(CallInfo(0.0, sent, int(messages[i + 1].size)))
        sent += messages[i + 1].size
    return Trajectory(name, bos, messages, calls, media or {})


def _trace(kind: str, sessions: list[Trajectory], requests: int, seed: int) -> TextTrace:
    return TextTrace(f"generated {kind}(requests={requests}, seed={seed})", kind, sessions, page_size=None)


def agent_sessions(requests: int = 20_000, seed: int = 0) -> TextTrace:
    d, sessions, n = _Draw(seed), [], 0
    while n < requests:
        calls = int(d.rng.integers(8, 25))
        messages = [d.tokens(d.pages(4, 8) - 1)]
        for _ in range(calls):  # half a page of tool output in, half a page of action out: a page a call
            messages += [d.tokens(PAGE // 2), d.tokens(PAGE // 2)]
        sessions.append(_session(f"agent{len(sessions):05d}", messages))
        n += calls
    return _trace("agent-sessions", sessions, requests, seed)


def _chat(d: _Draw, system: np.ndarray, turns: int, first: np.ndarray | None = None) -> list[np.ndarray]:
    messages = [system]
    for t in range(turns):
        user = d.tokens(d.pages(1, 3))
        messages += [user if t or first is None else np.concatenate([first, user]), d.tokens(d.pages(1, 2))]
    return messages


def ending_chats(requests: int = 20_000, seed: int = 0, kind: str = "ending-chats") -> TextTrace:
    d, sessions, n = _Draw(seed), [], 0
    systems = [d.tokens(d.pages(4, 8) - 1) for _ in range(4)]
    while n < requests:
        turns = int(d.rng.integers(2, 9))
        system = systems[int(d.rng.integers(len(systems)))]
        sessions.append(_session(f"chat{len(sessions):05d}", _chat(d, system, turns)))
        n += turns
    return _trace(kind, sessions, requests, seed)


def hot_prompts(requests: int = 20_000, seed: int = 0) -> TextTrace:
    d = _Draw(seed)
    systems = [d.tokens(d.pages(16, 64) - 1) for _ in range(8)]
    weights = 1.0 / np.arange(1, 9) ** 1.1
    picks = d.rng.choice(8, size=requests, p=weights / weights.sum())
    sessions = [_session(f"hot{i:05d}", [systems[k], d.tokens(d.pages(1, 4)), d.tokens(PAGE)])
                for i, k in enumerate(picks.tolist())]
    return _trace("hot-prompts", sessions, requests, seed)


def burst(requests: int = 20_000, seed: int = 0, at: float = 0.4) -> TextTrace:
    """``ending_chats`` with, ``at`` of the way in, four 32-page prompts each sent 16 times (one call each)."""
    base = ending_chats(requests - 64, seed, kind="burst")
    d = _Draw(seed + 1)
    prompts = [d.tokens(32 * PAGE - 1) for _ in range(4)]
    burst = [_session(f"burst{i:03d}", [prompts[i % 4], d.tokens(PAGE), d.tokens(PAGE)]) for i in range(64)]
    cut = int(at * len(base.sessions))
    base.sessions[cut:cut] = burst
    return base


def _image(k: int) -> MediaItem:
    digest = hashlib.blake2b(f"generated image {k}".encode(), digest_size=16).digest()
    return MediaItem(0, IMAGE_TOKENS, digest, "image", IMAGE_BYTES)


def encoder_stop(requests: int = 20_000, seed: int = 0, images: int = 400) -> TextTrace:
    """Chats whose first user turn starts with an image for the first half of the sessions, text only after."""
    d, sessions, n = _Draw(seed), [], 0
    systems = [d.tokens(d.pages(4, 8) - 1) for _ in range(4)]
    weights = 1.0 / np.arange(1, images + 1) ** 1.1
    weights /= weights.sum()
    with_images = []
    while n < requests:
        turns = int(d.rng.integers(2, 9))
        with_images.append(n < requests // 2)
        system = systems[int(d.rng.integers(len(systems)))]
        if with_images[-1]:
            item = _image(int(d.rng.choice(images, p=weights)))
            placeholders = np.zeros(IMAGE_TOKENS, dtype=np.int32)  # the rows an encoder output fills
            messages = _chat(d, system, turns, first=placeholders)
            sessions.append(_session(f"chat{len(sessions):05d}", messages, {1: (item,)}))
        else:
            sessions.append(_session(f"chat{len(sessions):05d}", _chat(d, system, turns)))
        n += turns
    return _trace("encoder-stop", sessions, requests, seed)


GENERATORS = {"agent-sessions": agent_sessions, "ending-chats": ending_chats, "hot-prompts": hot_prompts,
              "burst": burst, "encoder-stop": encoder_stop}
