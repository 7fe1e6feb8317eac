"""The flashinfer the CPU tests import (flashinfer has no CPU build). ``module()`` is import-only: Qwen3-Omni's
``components/talker.py:18`` imports flashinfer at module level, so ``mstar.model.qwen3_omni.submodules`` (its encoder
nodes included) cannot be imported without it, and the encoder nodes never call it. ``module(**kernels)`` also holds
the given attributes (torch stand-ins, ``tests/mstar_torch_kernels.py``). Any other attribute read raises, so a
kernel reached by mistake fails loudly instead of computing something else."""

import types


class _ImportOnly(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"{self.__name__}.{name}: the CPU stand-in has no such kernel; nothing else runs here")


def module(name: str = "flashinfer", **kernels) -> types.ModuleType:
    m = _ImportOnly(name)
    for attr, value in kernels.items():
        setattr(m, attr, value)
    return m
