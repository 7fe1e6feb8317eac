"""What every model-backed workload (``vlm-chat``, ``image-gen``, ``voice-clone``, ``agent``, ``mixed``) is built from.

A workload module exposes ``factory(options: ModelWorkloadOptions) -> Callable[[], Workload]`` (see
``workloads.harness.serving.Workload``): the factory loads data and models once, and each call returns a fresh workload
whose caches start empty, so the cache-off and cache-on runs of one replay see the same requests and weights.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path


def default_model_dir() -> Path:
    """Where tiny models built from configs are saved and loaded back with ``from_pretrained``."""
    return Path(os.environ.get("MMCACHE_MODEL_DIR", Path.home() / ".cache" / "mmcache" / "models"))


@dataclasses.dataclass(frozen=True)
class ModelWorkloadOptions:
    """``data``: the shared data folder (None: the workload's embedded, generated default). ``model``: a local model
    folder for real checkpoints (None: a tiny model built from config, saved under ``model_dir`` and loaded back
    through ``from_pretrained``). ``limit``: at most this many requests."""

    data: Path | None = None
    model: Path | None = None
    limit: int | None = None
    seed: int = 0
    page_size: int = 16
    pool_pages: int = 4096
    encoder_bytes: int = 256 << 20
    max_new_tokens: int = 8
    model_dir: Path = dataclasses.field(default_factory=default_model_dir)
