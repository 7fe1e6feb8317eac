"""Every code block of README.md and docs/*.md runs as written.

Each fenced block is a test case named ``<file>:<line>``:

- ```python blocks run with this interpreter in a fresh subprocess, in an empty temporary folder, with the repository
  root first on PYTHONPATH (what the editable install puts on sys.path), no model hub (HF_HUB_OFFLINE=1); they must
  exit 0. Every Python block runs: none may be marked no-run.
- ```bash and ```sh blocks run the same way under ``bash -e -o pipefail``.
- The fence's info string after the language is the marker:
    ```bash no-run: <reason>   not run; the test is skipped with the reason (installs packages, downloads, needs
                               the real data sets or a GPU, or takes minutes). Keep these few, and always give the reason.
    ```python slow             run only when slow tests are selected (marked ``slow``; ``-m "not slow"`` skips it).
- Blocks in any other language or with none (command synopses, YAML, plain text) are not run.

docs/testing.md describes the same convention for readers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from doc_pages import ROOT, blocks, doc_files

RUN = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
TIMEOUT_S = 600
MAX_NO_RUN = 12


def cases():
    out = []
    for path in doc_files():
        for line, lang, marker, code in blocks(path):
            if lang in RUN:
                out.append(pytest.param(path, line, RUN[lang], marker, code,
                                        id=f"{path.relative_to(ROOT)}:{line}",
                                        marks=[pytest.mark.slow]))  # each a fresh interpreter: seconds
    return out


CASES = cases()


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [e.get("PYTHONPATH")])])
    e.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


@pytest.mark.parametrize("path, line, runner, marker, code", CASES)
def test_block_runs_as_written(path, line, runner, marker, code, tmp_path):
    where = f"{path.relative_to(ROOT)}:{line}"
    if marker.startswith("no-run"):
        reason = marker.partition(":")[2].strip()
        assert runner == "bash", f"{where}: every Python block must run (no-run is for shell blocks only)"
        assert reason, f"{where}: a no-run block must say why (```bash no-run: <reason>)"
        pytest.skip(f"{where}: {reason}")
    assert marker in ("", "slow"), f"{where}: unknown marker {marker!r} (use 'no-run: <reason>' or 'slow')"
    script = tmp_path / ("block.py" if runner == "python" else "block.sh")
    script.write_text(code, encoding="utf-8")
    cmd = [sys.executable, str(script)] if runner == "python" else ["bash", "-e", "-o", "pipefail", str(script)]
    work = tmp_path / "cwd"
    work.mkdir()
    try:
        done = subprocess.run(cmd, cwd=work, env=env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{where}: still running after {TIMEOUT_S} s")
    assert done.returncode == 0, (f"{where} exited {done.returncode}\n--- code\n{code}--- stdout\n"
                                  f"{done.stdout[-4000:]}--- stderr\n{done.stderr[-6000:]}")


def test_blocks_were_found_and_no_run_blocks_stay_few():
    langs = [c.values[2] for c in CASES]
    assert langs.count("python") >= 10, "the README and docs/ should hold runnable Python examples"
    no_run = [c.id for c in CASES if c.values[3].startswith("no-run")]
    assert len(no_run) <= MAX_NO_RUN, f"too many no-run blocks ({len(no_run)}): {no_run}"
