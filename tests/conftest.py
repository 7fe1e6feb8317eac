"""Shared test helpers: where the real workload data lives, hypothesis profiles sized for a 2-core CI box, tiny
models built through ``workloads.fixtures``, the tiny multimodal chat workload of the harness tests (``tiny_chat.py``,
through the fixtures ``tiny_model``, ``tiny_media``, ``tiny_chat``), and the encoder-store helpers."""

import dataclasses
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from PIL import Image

from mmcache import EncoderKey
from tiny_chat import TinyChat, TinyModel, make_media

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def shared_data() -> Path | None:
    """The data folder the replays read (``workloads.registry.data_place``: $MMCACHE_DATA, else ../shared/data) when
    present; a user's clone has neither."""
    from workloads.registry import data_place
    path = data_place()[0]
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


@pytest.fixture
def sampled(monkeypatch):
    """M*'s CPU stand-ins for one test (``workloads.peers.mstar_cpu_kernels.install``: flashinfer's kernels, M*'s
    RoPE op on CPU, the greedy sampler), undone after it; what the sampler was handed (logits kept). The M* tests
    that need more stand-ins, or the stand-ins for a whole module, say so where they override it."""
    from workloads.peers import mstar_cpu_kernels

    return mstar_cpu_kernels.install(monkeypatch)


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


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory) -> Path:
    """A folder holding a tiny random Llama (vocabulary 512), saved by ``workloads.fixtures.saved``: for tests that load
    it with ``from_pretrained`` in several dtypes and attention backends, or in another process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return save_tiny(tmp_path_factory, "llama-512", lambda: LlamaForCausalLM(config))


def random_tokens(n: int, seed: int) -> list[int]:
    """``n`` token ids below 500, a function of ``seed`` alone."""
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def png_bytes(seed: int, size=(48, 40)) -> bytes:
    """A small random RGB PNG, different per seed."""
    import io

    import numpy as np

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


@pytest.fixture(scope="module")
def tiny_model():
    """A warmed-up TinyModel on one intra-op thread (restored after): on a small shared box, torch's thread pool
    turns microsecond ops into milliseconds of contention and the measured service times into noise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m = TinyModel()
    m.prefill(np.arange(64, dtype=np.int32), [])  # first-call costs must not land on the cache-off run
    yield m
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_media(tmp_path_factory) -> dict[str, Path]:
    return make_media(tmp_path_factory.mktemp("media"))


@dataclasses.dataclass
class TinyChatKit:
    """What tests build TinyChat workloads from: ``factory(**kw)`` is a ``serving.compare`` factory, ``cls`` the
    class (to subclass), ``model`` and ``media`` its arguments."""

    model: TinyModel
    media: dict[str, Path]
    cls: type = TinyChat

    def factory(self, **kw):
        return lambda: self.cls(self.model, self.media, **kw)


@pytest.fixture(scope="module")
def tiny_chat(tiny_model, tiny_media) -> TinyChatKit:
    """A real tiny multimodal chat workload (see ``TinyChat``) on a warmed-up model and real media files."""
    return TinyChatKit(tiny_model, tiny_media)


# ---------------------------------------------------------------------------------------------------------------------
# EncoderStore helpers (tests/mmcache/test_encoder_store*.py); imported the same way.
STORE_PB = 64  # page bytes in most tests: 16 float32 per page


def store_key(i=0, fp="vit@abc/bf16/cpu", modality="image", salt=b"", ids=None):
    return EncoderKey(bytes([i]) * 16, fp, modality, salt, ids)


def store_floats(n, seed=0, dtype=torch.float32):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_same_value(a, b):
    """Bit-exact equality of two values (tensors or containers of tensors), dtypes and container types included."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
        assert torch.equal(a, b) or (a.is_floating_point() or a.is_complex()) and a.isnan().any()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same_value(a[k], b[k])
    else:
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_value(x, y)


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the other threads"
        time.sleep(0.001)


def store_all_free(store):
    return store.pool.num_free == store.pool.num_pages and not store.pool.counts.any()


# ---------------------------------------------------------------------------------------------------------------------
# The continuous-batching engine tests (tests/workloads/test_peer_transformers.py,
# tests/mmcache/hf/test_hf_continuous_batching.py): the same prompts and the plain ``generate`` reference on the tiny
# Llama, page 16, 6 new tokens.
ENGINE_P, ENGINE_NEW = 16, 6


@pytest.fixture(scope="module")
def prompts():
    """Five prompts: three share a 3-page prefix (one is another's prefix + more), two share nothing."""
    g = torch.Generator().manual_seed(13)
    ids = lambda n: torch.randint(3, 32000, (n,), generator=g).tolist()  # noqa: E731
    head = ids(3 * ENGINE_P)
    first = head + ids(21)
    return [first, head + ids(9), ids(40), first + ids(2 * ENGINE_P + 3), ids(3 * ENGINE_P + 5)]


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    """What plain greedy ``generate`` gives for ``prompts``."""
    with torch.inference_mode():
        return [tiny_llama.generate(torch.tensor([p]), max_new_tokens=ENGINE_NEW, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@pytest.fixture
def lingering_scrape(monkeypatch) -> dict:
    """What a replay's ``--metrics-linger`` serves after its runs: the exporter's page, scraped over HTTP from another
    thread while the command lingers (``["text"]`` once the command returned)."""
    import threading
    import urllib.request

    from workloads.commands import common

    scraped, linger = {}, common.linger_metrics

    def scrape_then_linger(exporter, seconds, port):
        t = threading.Thread(target=lambda: scraped.update(text=urllib.request.urlopen(
            f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()))
        t.start()
        linger(exporter, seconds, port)
        t.join()

    monkeypatch.setattr(common, "linger_metrics", scrape_then_linger)
    return scraped
