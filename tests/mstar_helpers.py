"""Helpers for the tests that drive M*'s real classes (``mstar-ai`` 0.2.1 from the package index). Test modules call
``require_mstar()`` first: it skips the module, with the line to run, when that M* is not installed."""

import pytest
import torch

from mmcache.mstar.requirement import why_unavailable


def require_mstar():
    """Skip the calling test module, with the line to run, unless mstar-ai 0.2.1 imports."""
    why = why_unavailable()
    if why is not None:
        pytest.skip(why, allow_module_level=True)


def all_equal(got: list, want: list) -> bool:
    """Two lists of tensors of the same length, each pair ``torch.equal``."""
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
