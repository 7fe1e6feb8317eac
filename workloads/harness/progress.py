"""Progress of long work: tqdm bars on stderr, and the switch that silences third-party bars.

The CLI shows progress when stderr is a terminal and ``--no-progress`` is not given; otherwise ``quiet_third_party``
turns off the bars transformers, diffusers and huggingface_hub would draw (model loads, denoising steps, downloads),
so logs and pipes get no carriage-return noise.
"""

from __future__ import annotations

import os
import sys


def progress_bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar over ``total`` steps (``update(n)``, ``close()``); a silent one unless ``enabled``."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, leave=False, unit="req",
                dynamic_ncols=True, mininterval=0.5)


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
