"""Model-backed text workloads: their requests (served by ``workloads.models.text.TextWorkload``).

Workloads (each ``factory(options) -> Callable[[], Workload]``, see ``workloads.options``):
- ``agent-model`` (``factory``): agent sessions whose every call re-sends the whole history. Real data: the
  mini-swe-agent trajectories under ``<data>/mini-swe-agent/trajs`` (``workloads.traces.swe_agent``: the history holds
  the recorded replies). Embedded default: generated sessions of the same shape (a shared system prompt, a task, then
  command / tool-output turns), tokenized with the same SentencePiece model.
- ``mooncake-model`` (``mooncake_factory``): the Mooncake conversation trace
  (``<data>/mooncake/conversation_trace.jsonl``) or the embedded 2,000-line slice. Each request keeps its first
  ``MOONCAKE_BLOCKS`` blocks, every 512-token block scaled down to ``2 * page_size`` tokens drawn from its hash id
  alone, so equal ids still mean equal prefixes.
Agent prompts are never truncated (that would break their prefix structure): instead at most ``CALLS_PER_SESSION``
calls of each trajectory are served, and ``options.limit`` (default ``DEFAULT_LIMIT``, ``MOONCAKE_DEFAULT_LIMIT``)
caps the requests, in listed order.

Model: without ``options.model`` the tiny Llama of ``workloads.fixtures``; ``options.model`` loads a user's local
folder instead, with its own tokenizer when the folder has one.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from mmcache.errors import TraceError
from workloads import fixtures, registry
from workloads.harness.serving import Request
from workloads.models.text import TextWorkload, text_factory
from workloads.options import ModelWorkloadOptions
from workloads.traces.mooncake import load_mooncake
from workloads.traces.swe_agent import Trajectory, load_swe_agent, render
from workloads.traces.text_trace import CallInfo

CALLS_PER_SESSION = 4
DEFAULT_LIMIT = 12            # requests of agent-model (its real prompts run to tens of thousands of tokens)
MOONCAKE_DEFAULT_LIMIT = 200  # requests of mooncake-model
MOONCAKE_BLOCKS = 4


# ------------------------------------------------------------------------------------------------------- agent-model
_WORDS = ("parser", "config", "value", "index", "request", "cache", "token", "buffer", "handler", "schema", "model",
          "field", "default", "error", "path", "module", "result", "offset", "stream", "record", "format", "limit")
_SYSTEM = ("You are a software engineer working in a Linux shell on a repository. Each reply has a short THOUGHT "
           "and exactly one bash command in a fenced block. The command runs and its output is the next message. "
           "Read code before editing it, change only what the task needs, run the tests, and finish with "
           "`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` when the fix is done.")


def agent_messages(rng: np.random.Generator, calls: int) -> list[tuple[str, str]]:
    """One generated session: system, task, then ``calls`` command / tool-output pairs (roles as in the traces)."""
    words = lambda k: " ".join(rng.choice(_WORDS, k))  # noqa: E731
    task = f"Fix the issue: {words(12)}.\nSteps to reproduce:\n" + "\n".join(f"- {words(8)}" for _ in range(4))
    messages = [("system", _SYSTEM), ("user", task)]
    for _ in range(calls):
        path = f"src/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py"
        messages.append(("assistant", f"THOUGHT: {words(10)}.\n\n```bash\ngrep -n {rng.choice(_WORDS)} {path}\n```"))
        lines = "\n".join(f"{path}:{rng.integers(1, 900)}: {words(int(rng.integers(4, 14)))}"
                          for _ in range(int(rng.integers(6, 24))))
        messages.append(("user", f"<returncode>0</returncode>\n<output>\n{lines}\n</output>"))
    return messages


def agent_trajectory(name: str, messages: list[tuple[str, str]], tok, start_s: float,
                     gap_s: float) -> Trajectory:
    """A ``swe_agent.Trajectory`` of generated messages, tokenized exactly as ``load_swe_agent`` does."""
    arrays = [np.asarray(t, dtype=np.int32) for t in tok.encode([render(r, c) for r, c in messages])]
    lengths = np.cumsum([0] + [a.size for a in arrays]) + 1
    calls = [CallInfo(start_s + i * gap_s, int(lengths[2 * i + 2]), int(arrays[2 * i + 2].size))
             for i in range((len(arrays) - 1) // 2)]
    return Trajectory(name, np.array([tok.bos_id()], dtype=np.int32), arrays, calls)


def _agent_requests(options: ModelWorkloadOptions) -> list[Request]:
    tok, limit = fixtures.text_tokenizer(options.model), options.limit or DEFAULT_LIMIT
    sessions = -(-limit // CALLS_PER_SESSION)
    if options.data is None:
        rng = np.random.default_rng(options.seed)
        trajs = [agent_trajectory(f"gen-{s}", agent_messages(rng, CALLS_PER_SESSION), tok, 1.5 * s, 6.0)
                 for s in range(sessions)]
    else:
        trace = load_swe_agent(Path(options.data) / registry.MODEL_WORKLOADS["agent-model"].data_path,
                               limit=sessions, tokenizer=tok)
        if trace.errors:
            raise trace.errors[0]
        trajs = trace.sessions
    calls = (t.build(i) for t in trajs for i in range(min(CALLS_PER_SESSION, len(t.calls))))
    return [Request(c.rid, c.session, c.arrival_s, c.token_ids) for c in itertools.islice(calls, limit)]


def factory(options: ModelWorkloadOptions) -> Callable[[], TextWorkload]:
    """``agent-model``: agent calls re-sending their history, through a tiny Llama (or ``options.model``)."""
    return text_factory("agent-model", options, lambda vocab: _agent_requests(options))


# ---------------------------------------------------------------------------------------------------- mooncake-model
def _block(hash_id: int, size: int, vocab: int) -> np.ndarray:
    """``size`` tokens in ``[0, vocab)`` that are a function of ``hash_id`` alone."""
    return np.random.default_rng(int(hash_id) % (1 << 64)).integers(0, vocab, size, dtype=np.int32)


def scaled_prompt(hash_ids: Sequence[int], input_length: int, block: int, vocab: int) -> np.ndarray:
    """The first ``MOONCAKE_BLOCKS`` blocks of a Mooncake request, ``block`` tokens per 512-token block, the last one
    cut in proportion to ``input_length``; equal id prefixes give equal token prefixes."""
    ids = list(hash_ids[:MOONCAKE_BLOCKS])
    n = min(-(-input_length * block // 512), len(ids) * block)
    return np.concatenate([_block(h, block, vocab) for h in ids])[:n]


def mooncake_factory(options: ModelWorkloadOptions) -> Callable[[], TextWorkload]:
    """``mooncake-model``: the Mooncake conversation trace (or its embedded slice), scaled down, through a tiny
    Llama (or ``options.model``); each 512-token block becomes ``2 * page_size`` tokens."""
    path = (registry.embedded_slice() if options.data is None
            else Path(options.data) / registry.MODEL_WORKLOADS["mooncake-model"].data_path)

    def requests(vocab: int) -> list[Request]:
        trace = load_mooncake(path, limit=options.limit or MOONCAKE_DEFAULT_LIMIT)
        if trace.errors:
            raise trace.errors[0]
        if not trace.sessions:
            raise TraceError(path, None, "no requests")
        return [Request(s.name, s.name, s.calls[0].arrival_s,
                        scaled_prompt(s.hash_ids, s.calls[0].prompt_len, 2 * options.page_size, vocab))
                for s in trace.sessions]

    return text_factory("mooncake-model", options, requests)
