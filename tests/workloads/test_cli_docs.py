"""docs/cli.md's "Every flag" section and ``--help`` name the same flags, command by command: a flag added to the
parser without a line in the docs, or a line left for a flag that went, fails here."""

import argparse
import re
from importlib import metadata
from pathlib import Path

import pytest

from workloads.cli import build_parser

CLI_DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
FLAG = re.compile(r"`(--?[a-z][a-z0-9-]*)")


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser`` and of its subcommands, at any depth."""
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= parser_flags(sub)
        found.update(action.option_strings)
    return found


def documented_flags() -> set[str]:
    """The flags of the first column of every table of the "Every flag" section."""
    text = CLI_DOC.read_text(encoding="utf-8").split("\n## Every flag\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    return {flag for cell in rows for flag in FLAG.findall(cell)}


def test_every_flag_of_help_is_in_the_docs_and_no_other():
    in_help, in_docs = parser_flags(build_parser()), documented_flags()
    assert not in_help - in_docs, f"in --help, not in docs/cli.md's Every flag: {sorted(in_help - in_docs)}"
    assert not in_docs - in_help, f"in docs/cli.md's Every flag, not in --help: {sorted(in_docs - in_help)}"


def test_version_comes_from_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"mmcache {metadata.version('mmcache')}\n"
