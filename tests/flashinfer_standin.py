"""The import-only flashinfer the CPU tests need: Qwen3-Omni's ``components/talker.py:18`` imports flashinfer at module
level, so ``mstar.model.qwen3_omni.submodules`` (its encoder nodes included) cannot be imported without it, and
flashinfer has no CPU build. The encoder nodes never call it; any attribute read raises, so a kernel reached by
mistake fails loudly instead of computing something else."""

import types


class _ImportOnly(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"flashinfer.{name}: the CPU stand-in only lets flashinfer be imported; no kernel runs here")


def module() -> types.ModuleType:
    return _ImportOnly("flashinfer")
