"""Shared test helpers: where the real workload data lives, and hypothesis profiles sized for a 2-core CI box."""

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def shared_data() -> Path | None:
    """../shared/data (or $MMCACHE_DATA) when present; a user's clone has neither."""
    env = os.environ.get("MMCACHE_DATA")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"
    return path if path.is_dir() else None


@pytest.fixture
def data_dir() -> Path:
    path = shared_data()
    if path is None:
        pytest.skip("real workload data not found: set MMCACHE_DATA or place it at ../shared/data")
    return path


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and a busy 2-core box makes OpenMP barriers spin for milliseconds.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- tiny models, built once per session through workloads.fixtures (one seeding rule, saved then loaded back) ------
@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dir):
    """The tiny Llama of the text workloads (eval mode)."""
    from workloads import fixtures
    from workloads.options import ModelWorkloadOptions

    return fixtures.load_llama(ModelWorkloadOptions(model_dir=tiny_model_dir))[0]


@pytest.fixture(scope="session")
def tiny_llava(tiny_model_dir):
    """``(model, image processor)`` of the tiny LLaVA of vlm-chat."""
    from workloads import fixtures
    from workloads.options import ModelWorkloadOptions

    model, processor, _ = fixtures.load_llava(ModelWorkloadOptions(model_dir=tiny_model_dir))
    return model, processor


def png_bytes(seed: int, size=(48, 40)) -> bytes:
    """A small random RGB PNG, different per seed."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "PNG")
    return buf.getvalue()


def save_tiny(tmp_path_factory, kind: str, build, *extra) -> Path:
    """A folder holding ``build()`` (a model built from a config) and ``extra`` (processors), saved by
    ``workloads.fixtures.saved``: weights drawn under its seeding rule, never from the global RNG."""
    from workloads import fixtures

    def save(folder: Path) -> None:
        for part in (build(), *extra):
            part.save_pretrained(folder)

    return fixtures.saved(tmp_path_factory.mktemp(kind), kind, kind, save)
