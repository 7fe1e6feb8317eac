"""The house has no climbs: each top-level package imports only from the packages below it (digests < mmcache <
encoders < workloads), read from every import statement of its files, lazy imports inside functions included."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["digests", "mmcache", "encoders", "workloads"]  # lowest first


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_imports_nothing_above_it(package):
    above = set(LAYERS[LAYERS.index(package) + 1:])
    climbs = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & above)
              for p in sorted((ROOT / package).rglob("*.py"))}
    assert {p: c for p, c in climbs.items() if c} == {}
