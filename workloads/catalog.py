"""Named workloads and how a replay target (a name, a path, or nothing) becomes a loaded trace.

A target is resolved in this order:
1. nothing: the embedded Mooncake slice shipped in ``workloads/data`` (works in any clone, offline);
2. a registered name (``mooncake``, ``agent`` and its aliases): a file under the shared data folder, which is
   ``--data``, else ``$MMCACHE_DATA``, else ``../shared/data`` if it exists. Names win over same-named files in the
   working directory; write ``./agent`` to mean the file;
3. an existing path: a file is read as Mooncake JSONL, a folder as mini-swe-agent trajectories.
Anything else is an error naming the known workloads.

Later workloads (``vlm-chat``, ``image-gen``, ``voice-clone``) register here with their own ``kind``; the command
line dispatches on ``kind``.
"""

from __future__ import annotations

import dataclasses
import os
from importlib import resources
from pathlib import Path
from typing import Callable

from .mooncake import load_mooncake
from .swe_agent import load_swe_agent
from .text_trace import TextTrace

DATA_ENV = "MMCACHE_DATA"


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    kind: str                  # "mooncake" or "swe-agent" (text replays)
    data_path: str             # relative to the shared data folder
    description: str
    aliases: tuple[str, ...] = ()


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("mooncake", "mooncake", "mooncake/conversation_trace.jsonl",
             "Mooncake FAST'25 conversation trace (12,031 requests, 512-token blocks)"),
    Workload("agent", "swe-agent", "mini-swe-agent/trajs",
             "mini-swe-agent SWE-bench trajectories (real agent text, tokenized)", ("swe-agent", "mini-swe-agent")),
)}
_BY_NAME = {alias: w for w in WORKLOADS.values() for alias in (w.name, *w.aliases)}

LOADERS: dict[str, Callable[..., TextTrace]] = {"mooncake": load_mooncake, "swe-agent": load_swe_agent}


class UnknownWorkload(ValueError):
    """A target that is neither a registered workload nor an existing path, or a name without its data."""


def embedded_slice() -> Path:
    """The Mooncake slice shipped with the package (first 2,000 lines; see workloads/data/NOTICE)."""
    return Path(str(resources.files("workloads") / "data" / "mooncake_slice.jsonl"))


def data_dir(explicit: str | Path | None = None) -> Path | None:
    """The shared data folder: ``explicit``, else ``$MMCACHE_DATA``, else ``../shared/data`` if present."""
    if explicit:
        return Path(explicit)
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV])
    guess = Path.cwd().parent / "shared" / "data"
    return guess if guess.is_dir() else None


def resolve(target: str | None, data: str | Path | None = None) -> tuple[str, Path]:
    """``(kind, path)`` for a replay target; raises ``UnknownWorkload`` with what to do instead."""
    if target is None:
        return "mooncake", embedded_slice()
    w = _BY_NAME.get(target)
    if w is not None:
        root = data_dir(data)
        if root is None:
            raise UnknownWorkload(f"workload {target!r} reads the shared data folder: pass --data PATH or set "
                                  f"{DATA_ENV}")
        path = root / w.data_path
        if not path.exists():
            raise UnknownWorkload(f"workload {target!r} expects {path}, which does not exist (check --data / "
                                  f"{DATA_ENV})")
        return w.kind, path
    path = Path(target)
    if path.is_file():
        return "mooncake", path
    if path.is_dir():
        return "swe-agent", path
    known = ", ".join(sorted(WORKLOADS))
    raise UnknownWorkload(f"unknown workload {target!r}: not a file or folder, and not one of: {known}")


def load(kind: str, path: str | Path, limit: int | None = None) -> TextTrace:
    """Load a trace of ``kind`` from ``path``; ``limit`` caps sessions (Mooncake: requests; agent: trajectories)."""
    return LOADERS[kind](path, limit=limit)
