"""mini-swe-agent trajectory loader: real agent text, tokenized once per message, prompts built lazily.

A trajectory (``*.traj.json``) holds ``messages: [{role, content}]`` as system, task, then assistant/user turns.
API call ``i`` sends ``messages[0 .. 2i+1]`` and its output is ``messages[2i+2]`` (the next assistant message).

Rendering uses one fixed template: ``<s>`` then, per message, ``[role]\\n`` + content + ``\\n``. Each message is
tokenized ONCE, framing included, and a prompt is the BOS token followed by its messages' token arrays, so:
- the prompt of call i+1 starts with the prompt of call i followed by output i (exact, by construction);
- only the per-message arrays stay in memory (about 3M tokens for 100 trajectories); the 55M+ prompt tokens are
  concatenated one call at a time in ``build``.

Arrival times (``order="timestamp"``): the assistant message's ``extra.response.created`` (unix seconds), made
relative to the earliest in the trace and never decreasing within a session. A call without it takes the previous
call's time; a session with none at all uses its call index (0, 1, 2, ...). Sessions are trajectories, in file-name
order. A file that is not valid JSON or does not alternate roles as above is skipped and recorded as a
``TraceError`` (line = None, the whole file); a missing folder raises ``TraceError``.
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Sequence

import numpy as np

from mmcache.errors import TraceError

from workloads.traces.text_trace import CallInfo, TextRequest, TextTrace

TOKENIZER_FILES = ("mistral_instruct_tokenizer_240323.model.v3", "mistral_instruct_tokenizer_241114.model.v7",
                   "tokenizer.model.v1")


def tokenizer_path() -> Path:
    """The SentencePiece model shipped in ``mistral_common/data`` (preferring the v3 instruct tokenizer)."""
    data = Path(str(resources.files("mistral_common") / "data"))
    for name in TOKENIZER_FILES:
        if (data / name).is_file():
            return data / name
    found = sorted(p for p in data.glob("*.model*") if p.is_file())
    if not found:
        raise FileNotFoundError(f"no SentencePiece model in {data}")
    return found[0]


@lru_cache(maxsize=2)
def load_tokenizer(path: str | None = None):
    """A ``sentencepiece.SentencePieceProcessor`` for ``path`` (default: ``tokenizer_path()``), loaded once."""
    import sentencepiece
    return sentencepiece.SentencePieceProcessor(model_file=str(path or tokenizer_path()))


def render(role: str, content: str) -> str:
    """The fixed chat template for one message."""
    return f"[{role}]\n{content}\n"


@dataclasses.dataclass(slots=True)
class Trajectory:
    """One agent run: per-message token arrays and per-call metadata; ``build`` concatenates a prompt."""

    name: str
    bos: np.ndarray                  # [bos_id], int32
    messages: list[np.ndarray]       # each message's tokens (template framing included), int32
    calls: list[CallInfo]

    def build(self, i: int) -> TextRequest:
        c = self.calls[i]
        prompt = np.concatenate([self.bos, *self.messages[: 2 * i + 2]])
        assert prompt.size == c.prompt_len
        return TextRequest(rid=f"{self.name}#{i}", session=self.name, arrival_s=c.arrival_s, token_ids=prompt,
                           names=None, output_ids=self.messages[2 * i + 2], output_len=c.output_len)


def _check_messages(messages) -> int:
    """Number of API calls in a message list, or ValueError saying what breaks the expected shape."""
    if not isinstance(messages, list) or len(messages) < 3:
        raise ValueError("'messages' must be a list of at least system, task and one assistant message")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {k} needs string 'role' and 'content'")
        want = "system" if k == 0 else "user" if k % 2 else "assistant"
        if m["role"] != want:
            raise ValueError(f"message {k} has role {m['role']!r}, expected {want!r}")
    return (len(messages) - 1) // 2


def _created(message) -> float | None:
    t = ((message.get("extra") or {}).get("response") or {}).get("created")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


def load_swe_agent(folder: str | Path, limit: int | None = None, tokenizer=None) -> TextTrace:
    """Read up to ``limit`` trajectories (file-name order) from ``folder`` (or its ``trajs/`` subfolder)."""
    folder = Path(folder)
    if folder.is_dir() and not any(folder.glob("*.traj.json")) and (folder / "trajs").is_dir():
        folder = folder / "trajs"
    if not folder.is_dir():
        raise TraceError(folder, None, "no such folder")
    files = sorted(folder.glob("*.traj.json"))
    if not files:
        raise TraceError(folder, None, "no *.traj.json files")
    sp = tokenizer or load_tokenizer()
    bos = np.array([sp.bos_id()], dtype=np.int32)
    raw: list[tuple[str, list[dict], int]] = []
    errors: list[TraceError] = []
    for path in files:
        if limit is not None and len(raw) >= limit:
            break
        try:
            messages = json.loads(path.read_text(encoding="utf-8")).get("messages")
            raw.append((path.name.removesuffix(".traj.json"), messages, _check_messages(messages)))
        except (ValueError, AttributeError, OSError) as e:
            errors.append(TraceError(path, None, str(e) or type(e).__name__))
    starts = [t for _, msgs, _ in raw for m in msgs if (t := _created(m)) is not None]
    t0 = min(starts) if starts else 0.0
    sessions = []
    for name, messages, n_calls in raw:
        token_lists = sp.encode([render(m["role"], m["content"]) for m in messages])
        arrays = [np.asarray(t, dtype=np.int32) for t in token_lists]
        lengths = np.cumsum([0] + [a.size for a in arrays]) + 1  # prompt_len of call i = lengths[2i+2]
        times = _arrivals([_created(messages[2 * i + 2]) for i in range(n_calls)], t0)
        calls = [CallInfo(times[i], int(lengths[2 * i + 2]), int(arrays[2 * i + 2].size)) for i in range(n_calls)]
        sessions.append(Trajectory(name, bos, arrays, calls))
    return TextTrace(source=str(folder), kind="swe-agent", sessions=sessions, page_size=None, errors=errors)


def _arrivals(created: Sequence[float | None], t0: float) -> list[float]:
    """Relative, non-decreasing arrival times; gaps filled from the previous call, index order if none at all."""
    if all(t is None for t in created):
        return [float(i) for i in range(len(created))]
    first = next(t for t in created if t is not None)
    out, last = [], None
    for t in created:
        t = first if t is None and last is None else last if t is None else t
        last = t if last is None else max(last, t)
        out.append(last - t0)
    return out
