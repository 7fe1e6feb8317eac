"""M*'s own thread-safety tests (test/modular/test_page_allocator_thread_safety.py), run unchanged against the
drop-in. The vendored file imports ``AllocationStatus``, which this M* snapshot no longer has, and builds its manager
with a helper that pokes M*'s private fields; we load the file as it is, give it a stand-in ``AllocationStatus`` for
the import only, and point its two module-level names (``_make_test_manager``, ``PageAllocator``) at the drop-in."""

import importlib.util
import inspect

import pytest

from mstar_helpers import config, dropin_manager, kv_tensor, require_mstar

require_mstar()

from mmcache.mstar import CountedPageAllocator, vendor  # noqa: E402

_FILE = vendor.mstar_root() / "test" / "modular" / "test_page_allocator_thread_safety.py"


def _load(monkeypatch, reuse: bool):
    from mstar.engine import kv_store
    monkeypatch.setattr(kv_store, "AllocationStatus", type("AllocationStatus", (), {}), raising=False)
    spec = importlib.util.spec_from_file_location("mstar_thread_safety_vendored", _FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def make_test_manager(max_num_pages=32, page_size=8):
        cfg = config(max_num_pages, page_size)
        return dropin_manager(cfg, kv_tensor(cfg), reuse=reuse)

    module._make_test_manager = make_test_manager
    module.PageAllocator = CountedPageAllocator
    return module


def _cases():
    if not _FILE.is_file():
        return []
    names = []
    for cls in ("TestPageAllocatorThreadSafety", "TestPagedAllocationManagerThreadSafety"):
        src = _FILE.read_text()
        body = src[src.index(f"class {cls}"):]
        end = body.find("\nclass ", 1)
        body = body if end < 0 else body[:end]
        names += [(cls, line.split("def ")[1].split("(")[0]) for line in body.splitlines()
                  if line.strip().startswith("def test_")]
    return names


@pytest.mark.parametrize("reuse", [False, True], ids=["reuse-off", "reuse-on"])
@pytest.mark.parametrize("cls,name", _cases())
def test_vendored_thread_safety(monkeypatch, cls, name, reuse):
    module = _load(monkeypatch, reuse)
    instance = getattr(module, cls)()
    method = getattr(instance, name)
    assert not inspect.signature(method).parameters
    method()


def test_all_six_vendored_tests_run():
    assert len(_cases()) == 6
