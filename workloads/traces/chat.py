"""Users' own chat logs: OpenAI-style JSONL (conversation logs or request logs) and ShareGPT JSON, as sessions.

Formats (``detect_format`` tells them apart from the file's first bytes):
- ``openai``: JSONL, one ``{"messages": [{"role": ..., "content": ...}, ...]}`` a line (a line may instead hold
  ShareGPT's ``{"conversations": [...]}``), read with the shared JSONL policy (``workloads.traces.jsonl``: the first
  malformed line raises ``TraceError`` with its line). Such a file is one of two kinds, told apart by what the lines
  hold (``workloads.traces.chat_kind``; ``openai-conversations`` / ``openai-requests`` name one instead):
  - a conversation log: each line a whole conversation, whatever its last turn;
  - a request log: each line one request as sent to the API, re-sending the history, with or without its reply;
- ``sharegpt``: one JSON list of ``{"conversations": [{"from": ..., "value": ...}, ...]}``; ``from`` ``human`` is
  ``user``, ``gpt`` (or ``chatgpt``, ``bard``, ``bing``, ``model``, ``assistant``) is ``assistant``, others keep their
  name; conversations. A malformed entry raises ``TraceError`` naming the file and the entry (0-based) in place of a
  line.
Content that is a list of parts (OpenAI's multimodal messages) is rendered as its text parts joined, each other part
as ``[<type>]``. Prompts are BOS + every message of the prompt in the fixed template of ``swe_agent.render``, each
message tokenized once per session, so a session's call i+1 starts with call i's prompt (and output, when known).

Conversation logs: each conversation is one session (``<file stem>-<line or entry>``); every assistant message with
at least one message before it is a call whose prompt is every earlier message and whose output is that message.
Call i of every session arrives at i (sessions start together: the logs carry no times).

Request logs: every line is one call, replayed as sent, arriving at its position in the file (``arrival_s`` = its
index among the requests). A line that ends in an assistant turn holds its reply: its prompt is every message before
that turn and its output that turn. A request continues the session of the latest earlier request whose messages are
a prefix of its own (its history), else it starts a session; a request without its reply on its line has for output
the assistant message that follows its prompt in the session's next request, when there is one (else none: the log
does not hold the reply).

Chat text is Unicode that UTF-8 can encode: a lone surrogate (JSON's ``"\\ud800"`` unpaired) is a malformed line.

Nothing is dropped silently: every line or conversation not replayed is counted in ``TextTrace.skipped`` by reason.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np

from mmcache.errors import TraceError
from workloads.traces.chat_kind import tell_kind
from workloads.traces.jsonl import check_file, encodable, load_json, load_jsonl
from workloads.traces.swe_agent import render
from workloads.traces.text_trace import CallInfo, TextRequest, TextTrace
from workloads.traces.tokenizer import load_tokenizer

ASSISTANT = {"assistant", "gpt", "chatgpt", "bard", "bing", "model"}
ROLES = {"human": "user"}


@dataclasses.dataclass(slots=True)
class ChatSession:
    """One session: per-message token arrays; call i's prompt is ``messages[:ends[i]]`` and its output
    ``messages[outputs[i]]`` (-1: not in the log)."""

    name: str
    bos: np.ndarray                  # [bos_id], or empty when the tokenizer has no BOS
    messages: list[np.ndarray]
    ends: list[int]
    outputs: list[int]
    calls: list[CallInfo]

    def build(self, i: int) -> TextRequest:
        k, c = self.outputs[i], self.calls[i]
        prompt = np.concatenate([self.bos, *self.messages[:self.ends[i]]])
        output = self.messages[k] if k >= 0 else np.zeros(0, dtype=np.int32)
        return TextRequest(rid=f"{self.name}#{i}", session=self.name, arrival_s=c.arrival_s, token_ids=prompt,
                           names=None, output_ids=output, output_len=c.output_len)


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
        text = encodable(_text(m[text_key] or ""), f"message {k}")
        out.append(("assistant" if role in ASSISTANT else ROLES.get(role, role), text))
    return out


@dataclasses.dataclass
class _Calls:
    """A session before tokenization: its messages, and per call the prompt end, output index and arrival."""

    name: str
    conv: list[tuple[str, str]]
    ends: list[int] = dataclasses.field(default_factory=list)
    outputs: list[int] = dataclasses.field(default_factory=list)
    arrivals: list[float] = dataclasses.field(default_factory=list)


def _tokenize(sessions: list[_Calls], tokenizer) -> list[ChatSession]:
    bos_id = tokenizer.bos_id()
    bos = np.array([bos_id] if bos_id >= 0 else [], dtype=np.int32)
    out = []
    for s in sessions:
        arrays = [np.asarray(t, dtype=np.int32) for t in tokenizer.encode([render(r, t) for r, t in s.conv])]
        lengths = np.cumsum([bos.size] + [a.size for a in arrays])  # prompt_len before message k = lengths[k]
        calls = [CallInfo(t, int(lengths[e]), int(arrays[k].size) if k >= 0 else 0)
                 for e, k, t in zip(s.ends, s.outputs, s.arrivals)]
        out.append(ChatSession(s.name, bos, arrays, s.ends, s.outputs, calls))
    return out


def _conversation_calls(convs: list[tuple[str, list[tuple[str, str]]]], skipped: Counter) -> list[_Calls]:
    """Each conversation a session, each assistant reply after another message a call (module docstring)."""
    sessions = []
    for name, conv in convs:
        outputs = [k for k, (role, _) in enumerate(conv) if role == "assistant" and k > 0]
        if not outputs:
            skipped["conversation without an assistant reply after a message"] += 1
            continue
        if outputs[-1] < len(conv) - 1:
            skipped["final turn without a reply (not replayed)"] += 1
        sessions.append(_Calls(name, conv, outputs, outputs, [float(i) for i in range(len(outputs))]))
    return sessions


def conversation_trace(source: str | Path, kind: str, convs: list[tuple[str, list[tuple[str, str]]]],
                       tokenizer=None) -> TextTrace:
    """``(name, [(role, text)])`` conversations as a trace of sessions by the conversation-log rules (module
    docstring); every loader of conversations (ShareGPT, MT-Bench, conversation logs) builds its trace here."""
    skipped: Counter = Counter()
    sessions = _tokenize(_conversation_calls(convs, skipped), tokenizer or load_tokenizer())
    return TextTrace(str(source), kind, sessions, skipped=dict(skipped))


def _request_calls(convs: list[tuple[str, list[tuple[str, str]]]], skipped: Counter) -> list[_Calls]:
    """Each line one call, joined to the session whose latest request its history extends (module docstring)."""
    sessions: list[_Calls] = []
    latest: dict[int, int] = {}  # hash of a session's latest request's messages -> session index
    arrival = 0
    for name, conv in convs:
        if not conv:
            skipped["line without messages"] += 1
            continue
        end = len(conv) - 1 if conv[-1][0] == "assistant" else len(conv)  # a last assistant turn is the reply
        if end == 0:
            skipped["line with a reply and no prompt"] += 1
            continue
        prefixes = [hash(tuple(conv[:k])) for k in range(len(conv) + 1)]
        found = next((latest.pop(prefixes[k]) for k in range(len(conv) - 1, 0, -1)  # the hash nominates, == decides
                      if prefixes[k] in latest and sessions[latest[prefixes[k]]].conv == conv[:k]), None)
        if found is None:
            found, session = len(sessions), _Calls(name, conv)
            sessions.append(session)
        else:
            session = sessions[found]
            if session.ends and len(conv) > session.ends[-1] and conv[session.ends[-1]][0] == "assistant":
                session.outputs[-1] = session.ends[-1]  # the reply to the previous call, re-sent here
            session.conv = conv
        session.ends.append(end)
        session.outputs.append(end if end < len(conv) else -1)
        session.arrivals.append(float(arrival))
        arrival += 1
        latest[prefixes[-1]] = found
    return sessions


def load_openai_chat(path: str | Path, limit: int | None = None, tokenizer=None, kind: str = "auto") -> TextTrace:
    """OpenAI-style JSONL (see the module docstring): at most ``limit`` lines; ``kind`` is ``conversations``,
    ``requests`` or ``auto`` (told from what the lines hold, ``chat_kind.tell_kind``; the trace's ``told`` says
    why)."""
    path = check_file(path)
    convs = load_jsonl(path, lambda row, n: (f"{path.stem}-{n}", conversation(row)), limit)
    told = None
    if kind == "auto":
        found, why = tell_kind([conv for _, conv in convs])
        kind, told = found.removeprefix("openai-"), why
    if kind == "conversations":
        trace = conversation_trace(path, "openai-conversations", convs, tokenizer)
    else:
        skipped: Counter = Counter()
        sessions = _tokenize(_request_calls(convs, skipped), tokenizer or load_tokenizer())
        trace = TextTrace(str(path), "openai-requests", sessions, skipped=dict(skipped))
    trace.told = told
    return trace


def load_openai_requests(path: str | Path, limit: int | None = None, tokenizer=None) -> TextTrace:
    """A request log: every line one request as sent (``load_openai_chat`` with ``kind="requests"``)."""
    return load_openai_chat(path, limit, tokenizer, kind="requests")


def load_openai_conversations(path: str | Path, limit: int | None = None, tokenizer=None) -> TextTrace:
    """A conversation log: every line one whole conversation (``load_openai_chat`` with ``kind="conversations"``)."""
    return load_openai_chat(path, limit, tokenizer, kind="conversations")


def load_sharegpt(path: str | Path, limit: int | None = None, tokenizer=None) -> TextTrace:
    """ShareGPT JSON (see the module docstring): at most ``limit`` conversations."""
    path = check_file(path)
    data = load_json(path)
    if not isinstance(data, list):
        raise TraceError(path, None, "expected a JSON list of {\"conversations\": [...]} entries")
    convs = []
    for k, row in enumerate(data[:limit]):
        try:
            convs.append((f"{path.stem}-{k}", conversation(row)))
        except ValueError as e:
            raise TraceError(path, None, f"entry {k}: {e}") from None
    return conversation_trace(path, "sharegpt", convs, tokenizer)


def detect_format(path: str | Path) -> str:
    """``swe-agent`` for a folder; for a regular file, from its first non-blank bytes: ``sharegpt`` for a JSON list,
    ``openai`` for JSONL whose first line has ``messages`` or ``conversations``; else ``mooncake``, whose reader then
    names what is wrong (a path that is not a regular file is never opened here)."""
    path = Path(path)
    if path.is_dir():
        return "swe-agent"
    if not path.is_file():  # a pipe would block and /dev/zero never end: the reader refuses it, unread
        return "mooncake"
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
    except (ValueError, RecursionError):
        return "mooncake"
    return "openai" if isinstance(row, dict) and ("messages" in row or "conversations" in row) else "mooncake"
