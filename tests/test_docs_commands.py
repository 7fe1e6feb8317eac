"""What the README's and docs' commands read is in a fresh clone: a public data set from the data folder ``mmcache
data fetch`` fills (``data/`` in the clone), or embedded data; never this project's ``../shared``, which a user's
clone does not have. And no page cites a file outside the repository. (The tests themselves may read ``../shared``
when it is there: ``conftest.py``.)"""

import re

import pytest

from doc_pages import ROOT, commands, doc_files

OUTSIDE = "../shared"
LINK = re.compile(r"\]\(([^)#\s]+)")


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_command_reads_this_projects_shared_folder(page):
    named = [f"{page.name}:{line}: {command}" for line, command in commands(page) if OUTSIDE in command]
    assert not named, "commands that read ../shared, which a clone does not have:\n" + "\n".join(named)


def test_the_results_tables_commands_are_seen():
    """The README's Results table is where a newcomer starts: its commands are among those checked."""
    seen = [c for _, c in commands(ROOT / "README.md")]
    assert sum(c.startswith(("mmcache replay", "python benchmarks/")) for c in seen) >= 10


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_cites_a_file_outside_the_repository(page):
    text = page.read_text(encoding="utf-8")
    assert "shared/notes" not in text
    outside = [target for target in LINK.findall(text) if "://" not in target
               and not (page.parent / target).resolve().is_relative_to(ROOT)]
    assert not outside, f"links out of the repository: {outside}"
