"""Text traces: sessions of calls, with cheap metadata up front and token arrays built only when replayed.

A trace is a list of sessions (a multi-turn conversation, an agent trajectory, or, where the trace gives no
sessions, one request each). A session knows every call's arrival time and lengths without building any token
array; ``Session.build(i)`` materializes call ``i``. JSONL loaders raise ``TraceError`` at the first malformed line
(``workloads.traces.jsonl``); a folder of trajectories skips a bad file and keeps its ``TraceError`` in
``TextTrace.errors``.

Invariants every loader keeps:
- ``build(i).token_ids`` has exactly ``calls[i].prompt_len`` tokens, int32, all >= 0;
- ``names``, when given, holds one 64-bit name per *full* page of the prompt (``prompt_len // page_size``) and
  equal names mean equal token prefixes;
- ``output_ids``, when given, has ``output_len`` tokens, and the session's next prompt starts with
  prompt + output (the agent re-sends its history), so finished output pages can be matched;
- ``media`` (multimodal traces; empty for text) lists the prompt's media items in prompt order, each a run of
  ``tokens`` placeholder rows from ``offset`` inside the prompt, named by its 16-byte digest: the marks the page
  names fold in, and for an item with a ``modality`` the key of its encoder output.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from workloads.service import ServiceModel

if TYPE_CHECKING:  # the CLI's --help imports this module, and mmcache imports torch
    from mmcache.errors import TraceError


@dataclasses.dataclass(frozen=True, slots=True)
class MediaItem:
    """One media item of a prompt: placeholder rows ``offset .. offset + tokens``, its digest, and what it takes to
    fill them. ``modality`` names the encoder that makes its rows ("image", "audio"), whose output is ``nbytes``
    bytes; None for rows the request already holds (generated audio frames a voice session sends back), which are
    named in the chain but never encoded."""

    offset: int
    tokens: int
    digest: bytes
    modality: str | None = None
    nbytes: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class TextRequest:
    """One API call of a text (or multimodal) workload, ready to admit."""

    rid: str
    session: str
    arrival_s: float
    token_ids: np.ndarray           # int32 prompt
    names: list[int] | None         # one per full page of the prompt, or None to let the cache compute them
    output_ids: np.ndarray | None   # int32 generated tokens, or None when the trace does not give them
    output_len: int
    media: tuple[MediaItem, ...] = ()

    @property
    def prompt_len(self) -> int:
        return int(self.token_ids.size)

    @property
    def marks(self) -> list[tuple[int, bytes]]:
        """``(offset, digest)`` of every media item: what ``page_names`` and ``PrefixCache.admit`` fold in."""
        return [(m.offset, m.digest) for m in self.media]

    @property
    def encoded(self) -> tuple[MediaItem, ...]:
        """The media items an encoder makes, in prompt order."""
        return tuple(m for m in self.media if m.modality is not None)


@dataclasses.dataclass(frozen=True, slots=True)
class CallInfo:
    """What ordering and pool sizing need about a call, known without building its tokens."""

    arrival_s: float
    prompt_len: int
    output_len: int


class Session(Protocol):
    """A sequence of calls in causal order (call i+1 is sent after call i's output)."""

    name: str
    calls: Sequence[CallInfo]

    def build(self, i: int) -> TextRequest: ...


@dataclasses.dataclass
class TextTrace:
    """Sessions in source order, the page size the trace fixes (None: any), and the lines that were skipped."""

    source: str
    kind: str                  # "mooncake", "swe-agent", "openai-conversations", "openai-requests", "sharegpt"
    sessions: list[Session]
    page_size: int | None = None
    first_audio_tokens: int | None = None  # audio output: tokens (frames) before the first audio chunk; None: text
    errors: list[TraceError] = dataclasses.field(default_factory=list)
    # readable records not replayed, by reason: a singular noun phrase that ``workloads.counts.counted`` puts in
    # the plural ("line without messages")
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    told: str | None = None    # when ``kind`` was told from the content (an OpenAI log), why, in words

    @property
    def malformed(self) -> int:
        """How many lines (or files) were skipped."""
        return len(self.errors)

    @property
    def num_requests(self) -> int:
        return sum(len(s.calls) for s in self.sessions)

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_len for s in self.sessions for c in s.calls)


def turn_calls(start_s: float, lengths: Sequence[tuple[int, int]], think_s: float, rng: np.random.Generator,
               service: ServiceModel | None = None) -> list[CallInfo]:
    """The calls of a generated session of ``(prompt_len, output_len)`` turns: the first sent at ``start_s``, each
    next one ``think_s`` (exponential mean, drawn from ``rng``) after the previous one would have ended unserved by
    any cache under ``service`` (default: the default ``ServiceModel``), so a session's calls stay in causal order."""
    service = ServiceModel() if service is None else service
    calls, t = [], start_s
    for prompt_len, output_len in lengths:
        calls.append(CallInfo(t, int(prompt_len), int(output_len)))
        t += service.duration(prompt_len, output_len) + float(rng.exponential(think_s))
    return calls
