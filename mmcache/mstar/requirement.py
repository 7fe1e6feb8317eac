"""The M* mmcache adapts to: ``mstar-ai`` 0.2.1 from the package index, installed beside mmcache, never copied.

``pip install -e ".[mstar]"`` (M*'s dependencies) then ``pip install --no-deps --ignore-requires-python
mstar-ai==0.2.1``: the release declares Python >= 3.12, yet every file compiles and its engine runs on 3.11 (measured:
docs/mstar.md, "Installing M* on 3.11"), so pip needs the flag on 3.11, and alone, since it loosens every package of its resolve.
Another M* (an older source checkout, an unreleased main) has another KV API; the adapter refuses it with the line to
run instead of failing later inside M*'s code.
"""

from __future__ import annotations

from importlib import metadata

MSTAR_VERSION = "0.2.1"
INSTALL = (f"pip install -e \".[mstar]\" && pip install --no-deps --ignore-requires-python "
           f"mstar-ai=={MSTAR_VERSION}")


def why_unavailable() -> str | None:
    """None when the M* this adapter targets is installed, else one line saying what is wrong and what to run."""
    try:
        version = metadata.version("mstar-ai")
    except metadata.PackageNotFoundError:
        return f"M* (mstar-ai {MSTAR_VERSION}) is not installed: {INSTALL}"
    if version != MSTAR_VERSION:
        return f"mmcache.mstar targets mstar-ai {MSTAR_VERSION}, found {version}: {INSTALL}"
    try:
        import mstar.engine.resources.kv.manager  # noqa: F401
    except ImportError as e:
        return f"mstar-ai {version} is installed but does not import ({e}): {INSTALL}"
    return None


def require_mstar() -> None:
    """Raise ``ImportError`` (with the line to run) unless mstar-ai 0.2.1 imports."""
    why = why_unavailable()
    if why is not None:
        raise ImportError(why)
