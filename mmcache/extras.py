"""Which extra brings a missing dependency, and the one line that says how to install it.

mmcache installs from a clone (the package index has no ``mmcache``), so every hint is ``pip install -e
".[EXTRA]"`` run in the clone. torchaudio is the exception: each torchaudio loads only beside its own torch, so its
hint is the release that matches the torch present (``torchaudio_hint``), never a torch change the user did not ask
for.
"""

from __future__ import annotations

import importlib

from mmcache.errors import MissingDependency

TORCHAUDIO_NEWEST = (2, 11)   # the newest torchaudio release; none loads beside a later torch
TORCHAUDIO_PINS_TORCH = (2, 9)  # releases up to here pin their torch, so the audio extra can resolve a pair


def install_hint(extra: str) -> str:
    """How to install ``extra`` from the clone."""
    return f"pip install -e \".[{extra}]\" in the mmcache clone"


def require(extra: str, purpose: str, *modules: str) -> None:
    """Import each of ``modules``; ``MissingDependency`` naming the first that fails, ``purpose`` and ``extra``."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            raise MissingDependency(f"{purpose} needs {module} (the {extra!r} extra): {install_hint(extra)}") \
                from None


def _torch_minor() -> tuple[int, int] | None:
    try:
        from importlib.metadata import version
        major, minor = version("torch").split("+")[0].split(".")[:2]
        return int(major), int(minor)
    except Exception:  # no torch, or a version string that is not X.Y...
        return None


def torchaudio_hint() -> str:
    """What to install for torchaudio beside the torch present."""
    torch = _torch_minor()
    if torch is None or torch <= TORCHAUDIO_PINS_TORCH:
        return install_hint("audio")
    x, y = torch
    if torch <= TORCHAUDIO_NEWEST:
        return f"pip install \"torchaudio=={x}.{y}.*\" (the build of torch {x}.{y})"
    return (f"no torchaudio release loads beside torch {x}.{y} (the newest, {TORCHAUDIO_NEWEST[0]}."
            f"{TORCHAUDIO_NEWEST[1]}, needs its own torch): use torch <= {TORCHAUDIO_NEWEST[0]}.{TORCHAUDIO_NEWEST[1]} "
            "for the audio encoders")


def import_torchaudio(submodule: str = ""):
    """``torchaudio`` (or ``torchaudio.<submodule>``); ``MissingDependency`` with ``torchaudio_hint`` when it is
    missing or built for another torch (it then fails to load its library: OSError or ImportError)."""
    try:
        return importlib.import_module("torchaudio" + (f".{submodule}" if submodule else ""))
    except (ImportError, OSError) as e:
        why = "not installed" if isinstance(e, ModuleNotFoundError) else "does not load beside this torch"
        raise MissingDependency(f"the audio encoders need torchaudio ({why}): {torchaudio_hint()}") from None
