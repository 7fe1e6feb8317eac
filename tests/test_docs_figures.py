"""One source per figure: every figure of the README's Results table is stated on a docs page that shows the same
command, with the same numbers near it, and carries the date it was measured. A figure re-measured on one page and
not the other fails here."""

import re

import pytest

from doc_pages import ROOT, commands, doc_files

NUMBER = re.compile(r"(?<![\w.,])\d+(?:[.,]\d+)*(?:-\d+(?:[.,]\d+)*)?")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
NEAR = (3, 40)  # lines before and after a command shown in prose or a block where its figures must stand


def normal(command: str) -> str:
    """A command as it is compared: without a trailing comment, its spaces collapsed."""
    return " ".join(command.split(" #")[0].split())


def results_rows() -> list[tuple[str, str, str, str]]:
    """(what, figure, measured, command) of each row of the README's Results table."""
    text = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 5 and cells[0] != "what":
            rows.append((cells[0], cells[1], cells[2], normal(cells[4].strip("`"))))
    return rows


def sources(command: str) -> list[tuple[str, list[str]]]:
    """(page, the lines where its figures must stand) for each place a docs page shows ``command``: the table row
    it is in, else the lines ``NEAR`` it (the paragraph and the table after it)."""
    found = []
    for page in doc_files()[1:]:  # docs/*.md: the README quotes, it is not a source
        lines = page.read_text(encoding="utf-8").splitlines()
        for line, shown in commands(page):
            if normal(shown) == command:  # a command in a table row has its figures in that row
                row = lines[line - 1].lstrip().startswith("|")
                near = [lines[line - 1]] if row else lines[max(0, line - 1 - NEAR[0]):line + NEAR[1]]
                found.append((page.name, near))
    return found


def _row(row):
    return pytest.param(row, id=row[0][:60])


def test_the_results_table_is_read():
    assert len(results_rows()) >= 12


@pytest.mark.parametrize("row", [_row(r) for r in results_rows()])
def test_each_readme_figure_stands_as_quoted_beside_its_command_on_a_docs_page(row):
    what, figure, measured, command = row
    assert DATE.search(measured), f"{what}: no date in {measured!r}"
    places = sources(command)
    assert places, f"{what}: no docs page shows `{command}`"
    numbers = NUMBER.findall(figure)
    assert numbers
    missing = [(page, [n for n in numbers if not any(n in line for line in near)]) for page, near in places]
    assert any(not m for _, m in missing), f"{what}: figures not beside `{command}` on its page: {missing}"
