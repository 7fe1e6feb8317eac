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
order, found flat (``<id>.traj.json``) or as mini-swe-agent writes them (``trajs/<id>/<id>.traj.json``).
A trajectory file that is not valid JSON or does not alternate roles as above is skipped and recorded as a
``TraceError`` (line = None, the whole file): a folder of agent runs often holds unfinished ones, and a file is a
whole session, not a line of one (JSONL traces follow ``workloads.traces.jsonl`` instead). A missing folder, or one
without trajectories, raises ``TraceError``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import numpy as np

from mmcache.errors import TraceError
from workloads.traces.jsonl import encodable, load_json
from workloads.traces.text_trace import CallInfo, MediaItem, TextRequest, TextTrace
from workloads.traces.tokenizer import load_tokenizer


def render(role: str, content: str) -> str:
    """The fixed chat template for one message."""
    return f"[{role}]\n{content}\n"


@dataclasses.dataclass(slots=True)
class Trajectory:
    """One session of messages (an agent run, a chat, a voice session): per-message token arrays and per-call
    metadata; ``build`` concatenates a prompt. Call ``i`` sends ``messages[: 2i+2]`` after ``bos``; message
    ``2i+2`` is its output.

    ``media``: message index -> its media items, offsets counted from the message's first token. ``outputs_resent``:
    the output message is the generated ids themselves (text), so ``build`` gives them as ``output_ids``; False when
    the next prompt sends back something other than the ids generated (audio frames as embedded rows), which a page
    name fixed at generation cannot stand for."""

    name: str
    bos: np.ndarray                  # [bos_id], int32
    messages: list[np.ndarray]       # each message's tokens (template framing included), int32
    calls: list[CallInfo]
    media: dict[int, tuple[MediaItem, ...]] = dataclasses.field(default_factory=dict)
    outputs_resent: bool = True

    def build(self, i: int) -> TextRequest:
        c = self.calls[i]
        sent = self.messages[: 2 * i + 2]
        prompt = np.concatenate([self.bos, *sent])
        assert prompt.size == c.prompt_len
        media, start = [], self.bos.size
        for k, message in enumerate(sent):
            media += [dataclasses.replace(m, offset=start + m.offset) for m in self.media.get(k, ())]
            start += message.size
        return TextRequest(rid=f"{self.name}#{i}", session=self.name, arrival_s=c.arrival_s, token_ids=prompt,
                           names=None, output_ids=self.messages[2 * i + 2] if self.outputs_resent else None,
                           output_len=c.output_len, media=tuple(media))


def trajectory_files(folder: str | Path) -> tuple[Path, list[Path]]:
    """``(folder, files)``: the ``*.traj.json`` files of ``folder`` (or of its ``trajs/`` subfolder), flat
    (``<id>.traj.json``) or in the layout mini-swe-agent writes (``<id>/<id>.traj.json``), sorted by name; a
    ``TraceError`` saying which layouts were looked for when there is none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TraceError(folder, None, "no such folder")
    for root in (folder, folder / "trajs"):
        files = sorted({*root.glob("*.traj.json"), *root.glob("*/*.traj.json")}, key=lambda p: (p.name, str(p)))
        if files:
            return root, files
    raise TraceError(folder, None, "no trajectories: looked for *.traj.json and */*.traj.json (mini-swe-agent's "
                     "trajs/<id>/<id>.traj.json), here and under trajs/")


def _check_messages(messages) -> int:
    """Number of API calls in a message list, or ValueError saying what breaks the expected shape."""
    if not isinstance(messages, list) or len(messages) < 3:
        raise ValueError("'messages' must be a list of at least system, task and one assistant message")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {k} needs string 'role' and 'content'")
        encodable(m["content"], f"message {k}")
        want = "system" if k == 0 else "user" if k % 2 else "assistant"
        if m["role"] != want:
            raise ValueError(f"message {k} has role {m['role']!r}, expected {want!r}")
    return (len(messages) - 1) // 2


def _created(message) -> float | None:
    t = ((message.get("extra") or {}).get("response") or {}).get("created")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


def load_swe_agent(folder: str | Path, limit: int | None = None, tokenizer=None) -> TextTrace:
    """Read up to ``limit`` trajectories (file-name order) from ``folder`` (see ``trajectory_files``)."""
    folder, files = trajectory_files(folder)
    sp = tokenizer or load_tokenizer()
    bos = np.array([sp.bos_id()], dtype=np.int32)
    raw: list[tuple[str, list[dict], int]] = []
    errors: list[TraceError] = []
    for path in files:
        if limit is not None and len(raw) >= limit:
            break
        try:
            messages = load_json(path).get("messages")
            raw.append((path.name.removesuffix(".traj.json"), messages, _check_messages(messages)))
        except TraceError as e:
            errors.append(e)
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
