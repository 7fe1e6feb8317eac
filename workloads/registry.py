"""Named workloads and how a replay target (a name, a path, or nothing) becomes a loaded trace.

A target is resolved in this order:
1. nothing: the embedded Mooncake slice shipped in ``workloads/data`` (works in any clone, offline);
2. a registered name (``mooncake``, ``agent`` and its aliases): a file under the shared data folder, which is
   ``--data``, else ``$MMCACHE_DATA``, else ``../shared/data`` if it exists. Names win over same-named files in the
   working directory; write ``./agent`` to mean the file;
3. an existing path: a file is read as Mooncake JSONL, a folder as mini-swe-agent trajectories.
Anything else is an error naming the known workloads.

Model-backed workloads (``MODEL_WORKLOADS``: ``vlm-chat``, ``image-gen``, ``voice-clone``, ``agent-model``,
``mooncake-model``, ``mixed``) run real models with the cache off and on (``workloads.harness.serving.compare``). Each names
the module and function that build it (``factory(options) -> Callable[[], Workload]``), imported only when asked
for, so a workload whose module or dependencies are missing fails alone, with ``UnknownWorkload`` saying why. Without
``--data`` a model workload runs its embedded default; with it, ``model_data`` resolves the shared data folder as for
the text workloads and checks that the workload's data is there.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from importlib import resources
from pathlib import Path
from typing import Callable

from workloads.traces.mooncake import load_mooncake
from workloads.traces.swe_agent import load_swe_agent
from workloads.traces.text_trace import TextTrace

DATA_ENV = "MMCACHE_DATA"


@dataclasses.dataclass(frozen=True)
class TraceWorkload:
    name: str
    kind: str                  # "mooncake" or "swe-agent" (text replays)
    data_path: str             # relative to the shared data folder
    description: str
    aliases: tuple[str, ...] = ()


WORKLOADS: dict[str, TraceWorkload] = {w.name: w for w in (
    TraceWorkload("mooncake", "mooncake", "mooncake/conversation_trace.jsonl",
             "Mooncake FAST'25 conversation trace (12,031 requests, 512-token blocks)"),
    TraceWorkload("agent", "swe-agent", "mini-swe-agent/trajs",
             "mini-swe-agent SWE-bench trajectories (real agent text, tokenized)", ("swe-agent", "mini-swe-agent")),
)}
_BY_NAME = {alias: w for w in WORKLOADS.values() for alias in (w.name, *w.aliases)}

LOADERS: dict[str, Callable[..., TextTrace]] = {"mooncake": load_mooncake, "swe-agent": load_swe_agent}


@dataclasses.dataclass(frozen=True)
class ModelWorkload:
    name: str
    module: str                # imported on first use
    function: str              # ``function(options: ModelWorkloadOptions) -> Callable[[], Workload]``
    data_path: str             # relative to the shared data folder ("" for the folder itself)
    description: str


MODEL_WORKLOADS: dict[str, ModelWorkload] = {w.name: w for w in (
    ModelWorkload("vlm-chat", "workloads.models.vlm_chat", "factory", "mmmu/mmmu_pro_tool_sample_questions.jsonl",
                  "multi-turn chat about images, several users per image (MMMU-Pro questions; tiny LLaVA)"),
    ModelWorkload("image-gen", "workloads.models.image_gen", "factory", "diffusiondb/diffusiondb_5k.jsonl",
                  "text-to-image requests with a shared negative prompt (DiffusionDB prompts)"),
    ModelWorkload("voice-clone", "workloads.models.voice_clone", "factory", "seedtts/meta.lst",
                  "TTS requests cloning a few reference voices (Seed-TTS-Eval prompts)"),
    ModelWorkload("agent-model", "workloads.models.agent", "factory", "mini-swe-agent/trajs",
                  "agent calls re-sending their history (mini-swe-agent trajectories; tiny Llama)"),
    ModelWorkload("mooncake-model", "workloads.models.agent", "mooncake_factory", "mooncake/conversation_trace.jsonl",
                  "Mooncake conversation trace, scaled to 4 blocks per request (tiny Llama)"),
    ModelWorkload("mixed", "workloads.models.mixed", "factory", "",
                  "vlm-chat, agent-model, image-gen and voice-clone interleaved by arrival time"),
)}


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
    known = ", ".join(sorted(WORKLOADS | MODEL_WORKLOADS))
    raise UnknownWorkload(f"unknown workload {target!r}: not a file or folder, and not one of: {known}")


def load(kind: str, path: str | Path, limit: int | None = None) -> TextTrace:
    """Load a trace of ``kind`` from ``path``; ``limit`` caps sessions (Mooncake: requests; agent: trajectories)."""
    return LOADERS[kind](path, limit=limit)


def model_data(name: str, data: str | Path | None) -> Path | None:
    """The shared data folder for model workload ``name``: None (its embedded default) when ``data`` is None;
    ``data_dir(data)`` otherwise (``""``: ``$MMCACHE_DATA`` or ../shared/data), which must hold its data."""
    if data is None:
        return None
    root = data_dir(data)
    if root is None:
        raise UnknownWorkload(f"workload {name!r} with --data reads the shared data folder: pass --data PATH or set "
                              f"{DATA_ENV}")
    path = root / MODEL_WORKLOADS[name].data_path
    if not path.exists():
        raise UnknownWorkload(f"workload {name!r} expects {path}, which does not exist (check --data / {DATA_ENV})")
    return root


def import_model_module(name: str):
    """The module of model workload ``name``; ``UnknownWorkload`` saying why when it cannot be imported."""
    w = MODEL_WORKLOADS[name]
    try:
        return importlib.import_module(w.module)
    except ImportError as e:
        raise UnknownWorkload(f"workload {name!r} is not available: importing {w.module} failed ({e})") from e


def model_factory(name: str, options):
    """``factory(options)`` of model workload ``name``: loads its data and models once and returns what builds a
    fresh workload per run."""
    return getattr(import_model_module(name), MODEL_WORKLOADS[name].function)(options)
