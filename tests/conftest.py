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
