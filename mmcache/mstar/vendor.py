"""Where the M* source lives: ``$MMCACHE_MSTAR`` or ``../shared/vendor/mstar`` beside the checkout (M* is not on the
package index). ``import_mstar()`` puts it on ``sys.path`` once; the vendored files are imported, never edited."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def mstar_root() -> Path | None:
    """The M* source tree (the folder holding ``mstar/``), or None when neither location has it."""
    env = os.environ.get("MMCACHE_MSTAR")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[3] / "shared" / "vendor" / "mstar")
    for path in candidates:
        if (path / "mstar" / "engine" / "kv_store.py").is_file():
            return path
    return None


def import_mstar() -> Path:
    """Make ``import mstar`` work; raises ImportError naming both locations when M* is not found."""
    try:
        import mstar  # noqa: F401  (already importable: installed, or on the path)
        return Path(mstar.__file__).resolve().parents[1]
    except ImportError:
        pass
    root = mstar_root()
    if root is None:
        raise ImportError("M* source not found: set MMCACHE_MSTAR to a checkout of mstar-project/mstar, or place it "
                          "at ../shared/vendor/mstar")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return root
