"""Where Mooncake Store cannot run, the store tests' skip reason says what to do on that Python
(``mmcache.tiers.mooncake.install_advice``): on CPython 3.11 Linux install the extra; elsewhere (3.12, where no wheel
of the client exists) a Python 3.11 venv, never a pip command that cannot succeed."""

from mmcache.tiers import mooncake


def test_on_the_wheels_python_the_advice_is_the_extra_and_its_libraries():
    advice = mooncake.install_advice((3, 11), "linux")
    assert advice == 'pip install -e ".[tiers]" and apt-get install libibverbs1 librdmacm1 libnuma1'


def test_on_python_3_12_the_advice_is_a_3_11_venv():
    advice = mooncake.install_advice((3, 12), "linux")
    assert "pip cannot install it for Python 3.12" in advice
    assert 'use a Python 3.11 venv on Linux (python3.11 -m venv .venv-3.11, then pip install -e ".[dev]" in it)' in advice
    assert "pip install mooncake-transfer-engine-non-cuda" not in advice


def test_the_skip_reason_carries_the_advice_for_this_python(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_mooncake(name, *args, **kw):
        if name.startswith("mooncake"):
            raise ImportError("No module named 'mooncake'")
        return real_import(name, *args, **kw)
    monkeypatch.setattr(builtins, "__import__", no_mooncake)
    assert mooncake.available() == f"mooncake.store does not import (No module named 'mooncake'): " \
                                   f"{mooncake.install_advice()}"
