"""``mmcache``'s public names resolve on first use to the classes of the modules that define them, and importing a
torch-free module of the package (``mmcache.errors``, ``mmcache.extras``, ``mmcache.eviction``) imports no torch: the
command line checks its flags with them before anything heavy loads."""

import os
import subprocess
import sys
from pathlib import Path

import mmcache

ROOT = Path(__file__).resolve().parents[2]


def test_every_public_name_resolves_to_its_modules_object():
    assert sorted(mmcache.__all__) == sorted(mmcache._EXPORTS)
    for name in mmcache.__all__:
        module = sys.modules.get(mmcache._EXPORTS[name]) or __import__(mmcache._EXPORTS[name], fromlist=[name])
        assert getattr(mmcache, name) is getattr(module, name)
    assert set(mmcache.__all__) <= set(dir(mmcache))


def test_an_unknown_name_is_an_attribute_error():
    try:
        mmcache.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "no attribute 'NoSuchThing'" in str(e)
    else:
        raise AssertionError("mmcache.NoSuchThing resolved")


def test_the_torch_free_modules_import_no_torch():
    code = "import sys, mmcache.errors, mmcache.extras, mmcache.eviction; assert 'torch' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
