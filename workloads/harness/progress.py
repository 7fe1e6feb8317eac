"""Progress of long work: tqdm bars on stderr, and the switch that silences third-party bars.

The CLI shows progress when stderr is a terminal and ``--no-progress`` is not given; otherwise ``quiet_third_party``
turns off the bars transformers, diffusers and huggingface_hub would draw (model loads, denoising steps, downloads),
so logs and pipes get no carriage-return noise.
"""

from __future__ import annotations

import os
import sys


class _NoBar:
    """What ``progress_bar`` returns when disabled: the calls of a bar, doing nothing (and needing no tqdm)."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    @staticmethod
    def write(text: str, file=None) -> None:
        """Print ``text``, as a bar's ``write`` does around the bar it clears and redraws."""
        print(text, file=file or sys.stdout, flush=True)


def bars_available() -> bool:
    """Whether tqdm is installed (the ``replay`` extra); without it every bar is silent."""
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def progress_bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar over ``total`` steps (``update(n)``, ``write(text, file)`` for a line printed above it,
    ``close()``); a silent one unless ``enabled``."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, unit="req", dynamic_ncols=True, mininterval=0.5)


def quiet_third_party() -> None:
    """Silence the progress bars of transformers, diffusers and huggingface_hub (those installed), now and for
    modules imported later (through the environment variable huggingface_hub reads)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    for module, call in (("huggingface_hub.utils", "disable_progress_bars"),
                         ("transformers.utils.logging", "disable_progress_bar"),
                         ("diffusers.utils.logging", "disable_progress_bar")):
        try:
            getattr(__import__(module, fromlist=[call]), call)()
        except (ImportError, AttributeError):
            pass
