"""The extras never move the engine's torch: only ``audio`` names torchaudio, nothing names torch with a bound that
a newer torch fails, and every extra a user installs beside an engine (models, replay) leaves torch to the engine.
``benchmarks/bench_install.py`` shows the same in fresh venvs (minutes); this reads pyproject.toml (milliseconds)."""

from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

PROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
TORCH_BUILDS = {"torch", "torchaudio", "torchvision"}
NEWER_TORCH = "99.0"


def _requirements(extra: str) -> list[Requirement]:
    """The requirements ``.[extra]`` brings, with the project's own extras expanded."""
    out = []
    for text in PROJECT["optional-dependencies"][extra]:
        req = Requirement(text)
        out += [r for e in req.extras for r in _requirements(e)] if req.name == PROJECT["name"] else [req]
    return out


@pytest.mark.parametrize("extra", ["models", "replay"])
def test_extras_beside_an_engine_name_no_torch_build(extra):
    assert not [str(r) for r in _requirements(extra) if r.name in TORCH_BUILDS]


def test_core_takes_any_newer_torch():
    torch = [Requirement(t) for t in PROJECT["dependencies"] if Requirement(t).name == "torch"]
    assert torch and all(r.specifier.contains(NEWER_TORCH) for r in torch)


def test_the_license_file_is_the_licence_pyproject_names():
    assert PROJECT["license"] == {"text": "Apache-2.0"}
    text = (Path(__file__).resolve().parents[1] / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"] and "END OF TERMS AND CONDITIONS" in text


def test_torchaudio_only_in_audio_and_the_extras_that_include_it():
    """audio's, and mstar's (M*'s own dependency, listed there since M* installs with --no-deps)."""
    holders = {e for e in PROJECT["optional-dependencies"] if any(r.name == "torchaudio" for r in _requirements(e))}
    assert holders == {"audio", "mstar", "all", "dev"}
