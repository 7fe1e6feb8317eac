"""Every module keeps its privates and stays small: no file of the house imports a name with a leading underscore
from a module of the project (``digests``, ``mmcache``, ``encoders``, ``workloads``), lazy imports included, and no
module of ``mmcache`` is over 600 lines."""

from pathlib import Path

from test_layers import ROOT, imported_names

PROJECT = ("digests", "mmcache", "encoders", "workloads")
IMPORTERS = PROJECT + ("benchmarks", "tests")
MAX_LINES = 600


def is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def private_imports(path: Path) -> list[str]:
    """The dotted names ``path`` imports from the project that have a private part (a module or a name)."""
    return sorted(n for n in imported_names(path) if n.split(".")[0] in PROJECT and any(map(is_private, n.split("."))))


def test_no_module_imports_a_private_name_from_another():
    found = {(str(p.relative_to(ROOT)), name) for top in IMPORTERS for p in sorted((ROOT / top).rglob("*.py"))
             for name in private_imports(p)}
    assert found == set()


def test_no_module_of_mmcache_is_over_600_lines():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in sorted((ROOT / "mmcache").rglob("*.py"))}
    assert lines and {p: n for p, n in lines.items() if n > MAX_LINES} == {}
