"""A missing optional dependency is one line naming it and the install command that works from a clone."""

import sys

import pytest

from mmcache import extras
from mmcache.errors import MissingDependency


def test_require_names_the_module_the_extra_and_the_clone_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # None in sys.modules: import raises ImportError
    with pytest.raises(MissingDependency) as e:
        extras.require("replay", "progress bars", "numpy", "tqdm")
    assert str(e.value) == ("progress bars needs tqdm (the 'replay' extra): "
                            "pip install -e \".[replay]\" in the mmcache clone")
    assert isinstance(e.value, ImportError) and "\n" not in str(e.value)


@pytest.mark.parametrize("torch, hint", [
    ((2, 9), '".[audio]"'), (None, '".[audio]"'), ((2, 10), '"torchaudio==2.10.*"'), ((2, 11), '"torchaudio==2.11.*"'),
    ((2, 14), "no torchaudio release loads beside torch 2.14")])
def test_torchaudio_hint_matches_the_torch_present(monkeypatch, torch, hint):
    monkeypatch.setattr(extras, "_torch_minor", lambda: torch)
    assert hint in extras.torchaudio_hint()


def test_missing_torchaudio_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchaudio", None)
    with pytest.raises(MissingDependency, match=r"^the audio encoders need torchaudio \(not installed\): "):
        extras.import_torchaudio()
