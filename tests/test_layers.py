"""The house has no climbs, read from every import statement of its files, lazy imports inside functions included:
each top-level package imports only from the packages below it (digests < mmcache < encoders < workloads), the
adapters to engines (``mmcache.mstar``, ``mmcache.hf``) stand above the core they adapt (nothing else of ``mmcache``
imports them), and inside ``workloads`` each room (a module or package right under it) imports only from rooms on the
floors below its own."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["digests", "mmcache", "encoders", "workloads"]  # lowest first
WORKLOADS = ROOT / "workloads"
WORKLOADS_FLOORS = [  # top first; rooms on one floor import nothing of each other
    ["__main__"],
    ["cli"],
    ["commands"],
    ["datasets", "models", "sizing"],
    ["harness"],
    ["peers"],
    ["fixtures", "registry"],
    ["traces"],
    ["__init__", "admission", "counts", "interrupts", "options", "output_files", "service", "sizes"],
]
FLOOR = {room: len(WORKLOADS_FLOORS) - k for k, rooms in enumerate(WORKLOADS_FLOORS) for room in rooms}  # ground: 1


def imported_names(path: Path) -> set[str]:
    """The dotted name of everything an import statement of ``path`` brings in (``from P import n``: ``P.n``), with
    relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] if node.level else ())
            module = ".".join(p for p in (base, node.module) if p)
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def imported_packages(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_names(path)}


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_imports_nothing_above_it(package):
    above = set(LAYERS[LAYERS.index(package) + 1:])
    climbs = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & above)
              for p in sorted((ROOT / package).rglob("*.py"))}
    assert {p: c for p, c in climbs.items() if c} == {}


ADAPTERS = ("mstar", "hf")  # packages of mmcache that adapt it to an engine


def test_the_core_imports_no_adapter():
    core = [p for p in sorted((ROOT / "mmcache").rglob("*.py"))
            if p.relative_to(ROOT / "mmcache").parts[0] not in ADAPTERS]
    climbs = {str(p.relative_to(ROOT)): sorted(n for n in imported_names(p)
                                               if n.split(".")[:2] in (["mmcache", a] for a in ADAPTERS))
              for p in core}
    assert core and {p: c for p, c in climbs.items() if c} == {}


def room_of_file(path: Path) -> str:
    """The room of ``workloads`` that file ``path`` is in: the module or package right under it."""
    return path.relative_to(WORKLOADS).parts[0].removesuffix(".py")


def room_of_name(name: str) -> str | None:
    """The room of ``workloads`` that dotted ``name`` lies in (``__init__`` for the package itself); None outside."""
    parts = name.split(".")
    return None if parts[0] != "workloads" else parts[1] if len(parts) > 1 else "__init__"


def test_every_room_of_workloads_stands_on_one_floor():
    assert len(sum(WORKLOADS_FLOORS, [])) == len(FLOOR)  # no room on two floors
    assert {room_of_file(p) for p in WORKLOADS.rglob("*.py")} == set(FLOOR)


@pytest.mark.parametrize("room", sorted(FLOOR))
def test_a_room_of_workloads_imports_only_rooms_below_it(room):
    files = sorted(p for p in WORKLOADS.rglob("*.py") if room_of_file(p) == room)
    floor = FLOOR[room]
    climbs = {str(p.relative_to(ROOT)): sorted({r for r in map(room_of_name, imported_names(p))
                                                  if r not in (None, room) and FLOOR.get(r, floor) >= floor})
              for p in files}
    assert {p: c for p, c in climbs.items() if c} == {}
