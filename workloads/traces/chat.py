"""Users' own chat logs: OpenAI-style chat JSONL and ShareGPT JSON, read as sessions that re-send their history.

Formats (``detect_format`` tells them apart from the file's first bytes):
- ``openai``: JSONL, one conversation a line: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (the request
  format serving benchmarks replay). A line may instead hold ShareGPT's ``{"conversations": [...]}``. Read with the
  shared JSONL policy (``workloads.traces.jsonl``: the first malformed line raises ``TraceError`` with its line);
- ``sharegpt``: one JSON list of ``{"conversations": [{"from": ..., "value": ...}, ...]}``; ``from`` ``human`` is
  ``user``, ``gpt`` (or ``chatgpt``, ``bard``, ``bing``, ``model``, ``assistant``) is ``assistant``, others keep their
  name. A malformed entry raises ``TraceError`` naming the file and the entry (0-based) in place of a line.
Content that is a list of parts (OpenAI's multimodal messages) is rendered as its text parts joined, each other part
as ``[<type>]``.

Sessions: each conversation is one session (``<file stem>-<line or entry>``); every assistant message with at least
one message before it is a call whose prompt is BOS + every earlier message (the fixed template of
``swe_agent.render``, each message tokenized once) and whose output is that message, so call i+1's prompt starts with
call i's prompt and output, like an agent's. Conversations without such a message have nothing to replay and are
skipped. Arrival times: the logs carry none, so call i of every session arrives at i (sessions start together).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from mmcache.errors import TraceError
from workloads.traces.jsonl import check_file, load_jsonl
from workloads.traces.swe_agent import render
from workloads.traces.text_trace import CallInfo, TextRequest, TextTrace
from workloads.traces.tokenizer import load_tokenizer

ASSISTANT = {"assistant", "gpt", "chatgpt", "bard", "bing", "model"}
ROLES = {"human": "user"}


@dataclasses.dataclass(slots=True)
class ChatSession:
    """One conversation: per-message token arrays, and the message index of each call's output."""

    name: str
    bos: np.ndarray                  # [bos_id], or empty when the tokenizer has no BOS
    messages: list[np.ndarray]
    outputs: list[int]               # call i outputs messages[outputs[i]] after messages[:outputs[i]]
    calls: list[CallInfo]

    def build(self, i: int) -> TextRequest:
        k, c = self.outputs[i], self.calls[i]
        prompt = np.concatenate([self.bos, *self.messages[:k]])
        return TextRequest(rid=f"{self.name}#{i}", session=self.name, arrival_s=c.arrival_s, token_ids=prompt,
                           names=None, output_ids=self.messages[k], output_len=c.output_len)


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] if p.get("type") == "text" and isinstance(p.get("text"), str)
                       else f"[{p.get('type', 'part')}]" for p in content if isinstance(p, dict))
    raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def conversation(row) -> list[tuple[str, str]]:
    """``[(role, text)]`` of one OpenAI (``messages``) or ShareGPT (``conversations``) record; ValueError if neither."""
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        msgs, role_key, text_key = row["messages"], "role", "content"
    elif isinstance(row, dict) and isinstance(row.get("conversations"), list):
        msgs, role_key, text_key = row["conversations"], "from", "value"
    else:
        raise ValueError("expected an object with a 'messages' (OpenAI) or 'conversations' (ShareGPT) list")
    out = []
    for k, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get(role_key), str) or text_key not in m:
            raise ValueError(f"message {k} needs a string '{role_key}' and a '{text_key}'")
        role = m[role_key].lower()
        out.append(("assistant" if role in ASSISTANT else ROLES.get(role, role), _text(m[text_key] or "")))
    return out


def _sessions(convs: list[tuple[str, list[tuple[str, str]]]], tokenizer) -> list[ChatSession]:
    bos_id = tokenizer.bos_id()
    bos = np.array([bos_id] if bos_id >= 0 else [], dtype=np.int32)
    sessions = []
    for name, conv in convs:
        outputs = [k for k, (role, _) in enumerate(conv) if role == "assistant" and k > 0]
        if not outputs:
            continue
        arrays = [np.asarray(t, dtype=np.int32) for t in tokenizer.encode([render(r, t) for r, t in conv])]
        lengths = np.cumsum([bos.size] + [a.size for a in arrays])  # prompt_len before message k = lengths[k]
        calls = [CallInfo(float(i), int(lengths[k]), int(arrays[k].size)) for i, k in enumerate(outputs)]
        sessions.append(ChatSession(name, bos, arrays, outputs, calls))
    return sessions


def load_openai_chat(path: str | Path, limit: int | None = None, tokenizer=None) -> TextTrace:
    """OpenAI-style chat JSONL (see the module docstring): at most ``limit`` conversations."""
    path = check_file(path)
    convs = load_jsonl(path, lambda row, n: (f"{path.stem}-{n}", conversation(row)), limit)
    return TextTrace(str(path), "openai", _sessions(convs, tokenizer or load_tokenizer()))


def load_sharegpt(path: str | Path, limit: int | None = None, tokenizer=None) -> TextTrace:
    """ShareGPT JSON (see the module docstring): at most ``limit`` conversations."""
    path = check_file(path)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(path, None, f"not a JSON file: {e}") from None
    if not isinstance(data, list):
        raise TraceError(path, None, "expected a JSON list of {\"conversations\": [...]} entries")
    convs = []
    for k, row in enumerate(data[:limit]):
        try:
            convs.append((f"{path.stem}-{k}", conversation(row)))
        except ValueError as e:
            raise TraceError(path, None, f"entry {k}: {e}") from None
    return TextTrace(str(path), "sharegpt", _sessions(convs, tokenizer or load_tokenizer()))


def detect_format(path: str | Path) -> str:
    """``swe-agent`` for a folder; for a file, from its first non-blank bytes: ``sharegpt`` for a JSON list,
    ``openai`` for JSONL whose first line has ``messages`` or ``conversations``, else ``mooncake`` (whose reader then
    names what is wrong)."""
    path = Path(path)
    if path.is_dir():
        return "swe-agent"
    try:
        with open(path, "rb") as f:
            for raw in f:
                if raw.strip():
                    break
            else:
                return "mooncake"
    except OSError:
        return "mooncake"
    if raw.lstrip().startswith(b"["):
        return "sharegpt"
    try:
        row = json.loads(raw)
    except ValueError:
        return "mooncake"
    return "openai" if isinstance(row, dict) and ("messages" in row or "conversations" in row) else "mooncake"
