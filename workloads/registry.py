"""Every named workload in one table, where each one's data is, and how a replay target becomes a loaded trace.

``WORKLOADS`` holds both kinds, by name and alias:
- ``TraceWorkload``: a text trace replayed through a metadata-only prefix cache (``mmcache replay mooncake``);
- ``ModelWorkload``: requests served through real models with the cache off and on
  (``workloads.harness.serving.compare``). ``factory`` names ``module:function`` (``function(options:
  ModelWorkloadOptions) -> Callable[[], Workload]``), imported only when the workload runs, so ``mmcache --help``
  imports no model library and a workload whose dependencies are missing fails alone (``UnknownWorkload`` says why).
  ``replica_trace``, where set, names the ``module:function(data folder, limit=, seed=) -> TextTrace`` that turns the
  workload's data into a metadata trace with media for the replica replay (``mmcache replay NAME --replicas R``).
Trace loaders are referenced the same way (``LOADERS``: format -> ``module:function``).

A replay target is resolved in this order:
1. nothing: the embedded Mooncake slice shipped in ``workloads/data`` (works in any clone, offline);
2. a registered name: its ``data_path`` under the shared data folder (``find_data``); a generated one needs none.
   Names win over same-named files in the working directory; write ``./agent`` to mean the file;
3. an existing path, read in ``--format`` (default: ``chat.detect_format``: a folder is mini-swe-agent trajectories,
   a file Mooncake JSONL, OpenAI chat JSONL or ShareGPT JSON).
Anything else is an error: a path that is not there says so; any other name lists the known workloads.

The data folder (``data_place``, ``find_data``), for trace and model workloads and ``mmcache data fetch`` alike:
``--data PATH`` if given, else ``$MMCACHE_DATA`` if set, else ``default_data()``: the project's ``shared/data`` beside
this checkout when that folder exists (this project's development layout, which its tests and benchmarks read), else
``data/`` in the clone the package runs from (``clone_data``: an editable install), else, for a package installed
without a clone, the per-user data folder of the platform (``user_data``). So ``mmcache data fetch`` in a fresh clone
and the replays after it agree on one folder inside the clone. The first place given is the only one used; when it
lacks the workload's data, the error names the path looked for, every source in order, and the ``mmcache data fetch
NAME`` that fills it. A model workload runs its embedded default unless ``--data`` is given.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from importlib import resources
from pathlib import Path

DATA_ENV = "MMCACHE_DATA"
FORMATS = ("auto", "mooncake", "swe-agent", "openai", "openai-requests", "openai-conversations", "sharegpt")
LOADERS = {  # trace format -> "module:function(path, limit=..., [tokenizer=...]) -> TextTrace"
    "mooncake": "workloads.traces.mooncake:load_mooncake",
    "swe-agent": "workloads.traces.swe_agent:load_swe_agent",
    "openai": "workloads.traces.chat:load_openai_chat",  # requests or conversations, told from the lines
    "openai-requests": "workloads.traces.chat:load_openai_requests",
    "openai-conversations": "workloads.traces.chat:load_openai_conversations",
    "sharegpt": "workloads.traces.chat:load_sharegpt",
    "hot-prefix": "workloads.traces.hot_prefix:load_hot_prefix",  # generated: reads nothing
}
# formats with text, read with a tokenizer
TOKENIZED = ("swe-agent", "openai", "openai-requests", "openai-conversations", "sharegpt")


@dataclasses.dataclass(frozen=True)
class TraceWorkload:
    name: str
    format: str                # a key of LOADERS
    data_path: str             # relative to the shared data folder
    description: str
    aliases: tuple[str, ...] = ()
    generated: bool = False    # built by its loader from fixed parameters: no data, works in any clone


@dataclasses.dataclass(frozen=True)
class ModelWorkload:
    name: str
    factory: str               # "module:function", imported on first use
    data_path: str             # relative to the shared data folder ("" for the folder itself)
    description: str
    aliases: tuple[str, ...] = ()
    replica_trace: str = ""    # "module:function" of its replica-replay trace; "" for none
    output_unit: str = "tokens"  # what ``--max-new-tokens`` counts for it


WORKLOADS: dict[str, TraceWorkload | ModelWorkload] = {w.name: w for w in (
    TraceWorkload("mooncake", "mooncake", "mooncake/conversation_trace.jsonl",
                  "Mooncake FAST'25 conversation trace (12,031 requests, 512-token blocks)"),
    TraceWorkload("agent", "swe-agent", "mini-swe-agent/trajs",
                  "mini-swe-agent SWE-bench trajectories (real agent text, tokenized)",
                  ("swe-agent", "mini-swe-agent")),
    TraceWorkload("hot-prefix", "hot-prefix", "", "generated: 1,000 multi-turn users under 8 system prompts "
                  "picked by a Zipf law (s=1.1), for replica routing", ("skew",), generated=True),
    ModelWorkload("vlm-chat", "workloads.models.vlm_chat:factory", "mmmu/mmmu_pro_tool_sample_questions.jsonl",
                  "multi-turn chat about images, several users per image (MMMU-Pro questions; tiny LLaVA)",
                  replica_trace="workloads.traces.image_chats:load_image_chats"),
    ModelWorkload("image-gen", "workloads.models.image_gen:factory", "diffusiondb/diffusiondb_5k.jsonl",
                  "text-to-image requests with a shared negative prompt (DiffusionDB prompts)"),
    ModelWorkload("video-gen", "workloads.models.video_gen:factory", "diffusiondb/diffusiondb_5k.jsonl",
                  "text- and image-to-video (Wan 2.2 TI2V), shared negative prompt, several prompts per image "
                  "(DiffusionDB prompts, MMMU images)"),
    ModelWorkload("video-chat", "workloads.models.video_chat:factory", "mmmu/images",
                  "multi-turn questions about short clips made from MMMU images (tiny LLaVA-NeXT-Video)"),
    ModelWorkload("voice-clone", "workloads.models.voice_clone:factory", "seedtts/meta.lst",
                  "TTS requests cloning a few reference voices (Seed-TTS-Eval prompts)",
                  replica_trace="workloads.traces.voice_sessions:load_voice_sessions", output_unit="audio frames"),
    ModelWorkload("voice-mstar", "workloads.models.voice_mstar:factory", "seedtts/meta.lst",
                  "TTS requests cloning a few reference voices through M*'s Orpheus (LLM + SNAC decoder) under M*'s "
                  "Engine, many in flight (Seed-TTS-Eval prompts; tiny random weights)",
                  output_unit="SNAC frames (7 codes each)"),
    ModelWorkload("vlm-mstar", "workloads.models.vlm_mstar:factory", "mmmu/mmmu_pro_tool_sample_questions.jsonl",
                  "vlm-chat's image questions through M*'s Qwen3-Omni (vision encoder + thinker, text output) under "
                  "M*'s Engine, many in flight (MMMU-Pro questions; tiny random weights)"),
    ModelWorkload("agent-model", "workloads.models.agent:factory", "mini-swe-agent/trajs",
                  "agent calls re-sending their history (mini-swe-agent trajectories; tiny Llama)"),
    ModelWorkload("mooncake-model", "workloads.models.agent:mooncake_factory", "mooncake/conversation_trace.jsonl",
                  "Mooncake conversation trace, scaled to 4 blocks per request (tiny Llama)"),
    ModelWorkload("mixed", "workloads.models.mixed:factory", "",
                  "vlm-chat, agent-model, image-gen, voice-clone, video-gen and video-chat interleaved by arrival "
                  "time"),
)}
BY_NAME = {alias: w for w in WORKLOADS.values() for alias in (w.name, *w.aliases)}
TRACE_WORKLOADS = {n: w for n, w in WORKLOADS.items() if isinstance(w, TraceWorkload)}
MODEL_WORKLOADS = {n: w for n, w in WORKLOADS.items() if isinstance(w, ModelWorkload)}
REPLICA_WORKLOADS = tuple(n for n, w in MODEL_WORKLOADS.items() if w.replica_trace)


class UnknownWorkload(ValueError):
    """A target that is neither a registered workload nor an existing path, or a name without its data."""


def _import(ref: str):
    module, _, function = ref.partition(":")
    return getattr(importlib.import_module(module), function)


def embedded_slice() -> Path:
    """The Mooncake slice shipped with the package (first 2,000 lines; see workloads/data/NOTICE)."""
    return Path(str(resources.files("workloads") / "data" / "mooncake_slice.jsonl"))


def checkout_data() -> Path:
    """``../shared/data`` beside this checkout: where this project's shared folder is laid (an installed package's
    files have no such folder beside them)."""
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def clone_data() -> Path | None:
    """``data/`` at the root of the clone this package runs from (``pyproject.toml`` beside the packages, as an
    editable install leaves them; git ignores the folder), or None for a package installed without a clone."""
    root = Path(__file__).resolve().parents[1]
    return root / "data" if (root / "pyproject.toml").is_file() else None


def user_data() -> Path:
    """The per-user data folder, by the platform's convention: ``%LOCALAPPDATA%\\mmcache`` on Windows,
    ``~/Library/Application Support/mmcache`` on macOS, else ``$XDG_DATA_HOME/mmcache`` (an absolute
    ``$XDG_DATA_HOME``; else ``~/.local/share/mmcache``)."""
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "mmcache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "mmcache"
    xdg = os.environ.get("XDG_DATA_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share") / "mmcache"


def default_data() -> Path:
    """The data folder without ``--data`` or ``$MMCACHE_DATA``: ``checkout_data()`` when it exists, else
    ``clone_data()``, else (no clone) ``user_data()``."""
    beside = checkout_data()
    if beside.is_dir():
        return beside
    return clone_data() or user_data()


def _default_source(path: Path) -> str:
    if path == checkout_data():
        return "../shared/data beside this checkout"
    return "data/ in this clone" if path == clone_data() else "the per-user data folder"


def data_source(w: TraceWorkload | ModelWorkload) -> str:
    """The source of ``workloads/data/sources.json`` that holds ``w``'s data: the first folder of its data path."""
    return w.data_path.split("/")[0]


def has_data(path: Path) -> bool:
    """Whether ``path`` holds data: a file, or a folder with something in it other than downloads in progress
    (``.part`` files, which a failed ``mmcache data fetch`` leaves behind)."""
    if path.is_dir():
        return any(not p.name.endswith(".part") for p in path.iterdir())
    return path.exists()


def default_data_words() -> str:
    """The data folder's default in words, for ``--help``: the order ``data_place`` takes."""
    clone = clone_data()
    last = f"data/ in this clone, {clone}" if clone else f"the per-user data folder, {user_data()}"
    return (f"${DATA_ENV}, else ../shared/data beside this checkout when present (this project's development "
            f"layout), else {last}")


def data_place(explicit: str | Path | None = None) -> tuple[Path, str]:
    """The data folder and where it came from: ``--data``, else ``$MMCACHE_DATA``, else ``default_data()``. The first
    one given is the only one used: data from a folder the user did not name is never picked up."""
    if explicit:
        return Path(explicit), "--data"
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV]), f"${DATA_ENV}"
    path = default_data()
    return path, _default_source(path)


def find_data(name: str, explicit: str | Path | None = None) -> Path:
    """The shared data folder (``data_place``) when it holds workload ``name``'s data; else ``UnknownWorkload``
    naming the place looked and the state of every source (the same message for trace and model workloads)."""
    w = BY_NAME[name]
    root, how = data_place(explicit)
    if has_data(root / w.data_path):
        return root
    fallback = default_data()
    sources = [f"--data {explicit}" if explicit else "no --data PATH",
               f"${DATA_ENV}={os.environ[DATA_ENV]}" if os.environ.get(DATA_ENV) else f"${DATA_ENV} not set",
               f"{_default_source(fallback)} = {fallback}"]
    fetch = " ".join(filter(None, ["mmcache data fetch", data_source(w), f"--data {root}" if how == "--data" else ""]))
    raise UnknownWorkload(f"no data for workload {w.name!r}: looked for {root / w.data_path} (from {how}; "
                          f"searched in this order: {', '.join(sources)}). Run {fetch} first (it fills {root}), or "
                          f"pass --data PATH (the folder holding {w.data_path or 'the data'}) or set ${DATA_ENV}")


def resolve(target: str | None, data: str | Path | None = None, fmt: str = "auto") -> tuple[str, Path]:
    """``(format, path)`` for a trace replay target; raises ``UnknownWorkload`` with what to do instead."""
    if target is None:
        return "mooncake", embedded_slice()
    w = BY_NAME.get(target)
    if isinstance(w, TraceWorkload) and w.generated:
        return w.format, Path(w.name)
    if isinstance(w, TraceWorkload):
        return w.format, find_data(target, data) / w.data_path
    path = Path(target)
    if path.exists():
        if fmt == "auto":
            from workloads.traces.chat import detect_format
            fmt = detect_format(path)
        return fmt, path
    if path.suffix or "/" in target or os.sep in target:  # it names a file, not a workload
        raise UnknownWorkload(f"{target}: no such file or folder")
    known = ", ".join(sorted(WORKLOADS))
    raise UnknownWorkload(f"unknown workload {target!r}: not one of {known}, and no file or folder of that name")


def load(fmt: str, path: str | Path, limit: int | None = None, tokenizer: str | Path | None = None):
    """The ``TextTrace`` of ``path`` in format ``fmt``; ``limit`` caps sessions (Mooncake: requests)."""
    kw = {"limit": limit}
    if fmt in TOKENIZED:
        from workloads.traces.tokenizer import load_tokenizer
        kw["tokenizer"] = load_tokenizer(tokenizer)
    return _import(LOADERS[fmt])(path, **kw)


def model_data(name: str, data: str | Path | None) -> Path | None:
    """The shared data folder for model workload ``name``: None (its embedded default) when ``data`` is None, else
    ``find_data(name, data)`` (``""``: ``$MMCACHE_DATA``, else ``default_data()``)."""
    return None if data is None else find_data(name, data)


def replica_trace(name: str, data: str | Path | None, limit: int | None = None, seed: int = 0):
    """The replica-replay ``TextTrace`` of model workload ``name`` from the shared data folder (``find_data``: it needs
    its data, so ``UnknownWorkload`` names what it looked for when absent)."""
    w = MODEL_WORKLOADS[name]
    if not w.replica_trace:
        raise UnknownWorkload(f"--replicas: {name!r} has no replica replay; the model workloads that have one: "
                              f"{', '.join(REPLICA_WORKLOADS)}")
    return _import(w.replica_trace)(find_data(name, data), limit=limit, seed=seed)


def import_model_module(name: str):
    """The module of model workload ``name``; ``UnknownWorkload`` saying why when it cannot be imported."""
    module = MODEL_WORKLOADS[name].factory.partition(":")[0]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        from mmcache.errors import MissingDependency
        from mmcache.extras import install_hint
        why = e if isinstance(e, MissingDependency) else f"importing {module} failed ({e}); {install_hint('models')}"
        raise UnknownWorkload(f"workload {name!r} is not available: {why}") from e


def model_factory(name: str, options):
    """``factory(options)`` of model workload ``name``: loads its data and models once and returns what builds a
    fresh workload per run."""
    return getattr(import_model_module(name), MODEL_WORKLOADS[name].factory.partition(":")[2])(options)
