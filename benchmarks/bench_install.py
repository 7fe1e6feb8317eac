"""What installing mmcache costs, and that it leaves the engine's torch alone: fresh venvs, measured.

    python benchmarks/bench_install.py [--root /tmp/mmcache-install] [--torch 2.14.1]

1. ``beside-torch``: a venv with ``torch==TORCH`` installed first (the engine's), then ``pip install -e .`` (core),
   then ``-e ".[models]"``, then ``-e ".[models,replay]"``; after each step torch must still be TORCH. Prints the
   time and the venv's size after each step.
2. ``no-torch``: a venv without torch: ``pip install --dry-run --report`` of ``.[models]`` and of
   ``.[models,audio]``; prints the torch and torchaudio each would get (a matching pair, or no torchaudio).

Needs pip's index (or this machine's wheel folders) and several GB of disk; minutes, not seconds, so it is a
benchmark, not a test (``tests/test_packaging.py`` checks the extras' requirements in milliseconds).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def _size_mb(venv: Path) -> float:
    return sum(p.stat().st_size for p in venv.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6


def _version(python: Path, module: str) -> str:
    out = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version('{module}'))"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else "absent"


def _venv(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin" / "python"


def beside_torch(root: Path, torch: str) -> None:
    venv = root / "beside-torch"
    python = _venv(venv)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    print(f"venv {venv}: {_size_mb(venv):,.0f} MB empty")
    steps = [(f"torch=={torch}", [f"torch=={torch}"]), ("-e .", ["-e", str(ROOT)])]
    steps += [(f"-e .[{extras}]", ["-e", f"{ROOT}[{extras}]"]) for extras in ("models", "models,replay")]
    for label, spec in steps:
        seconds = _run(pip + spec)
        found = _version(python, "torch")
        status = "kept" if found == torch else f"CHANGED to {found}"
        print(f"  pip install {label:22} {seconds:6.1f} s, venv {_size_mb(venv):8,.0f} MB; torch {status}; "
              f"torchaudio {_version(python, 'torchaudio')}")


def no_torch(root: Path) -> None:
    venv = root / "no-torch"
    python = _venv(venv)
    for extras in ("models", "models,audio"):
        report = root / f"report-{extras.replace(',', '-')}.json"
        _run([str(python), "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--report",
              str(report), "-e", f"{ROOT}[{extras}]"])
        installs = json.loads(report.read_text())["install"]
        got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}
        print(f"  no torch, .[{extras}]: would install torch {got.get('torch', 'none')}, "
              f"torchaudio {got.get('torchaudio', 'none')} ({len(got)} packages)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/mmcache-install"))
    parser.add_argument("--torch", default="2.14.1", help="the engine's torch, installed first")
    parser.add_argument("--skip", choices=("beside-torch", "no-torch"), action="append", default=[])
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    if "no-torch" not in args.skip:
        no_torch(args.root)
    if "beside-torch" not in args.skip:
        beside_torch(args.root, args.torch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
