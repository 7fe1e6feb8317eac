"""``mmcache data list|fetch``: the public data sets of ``workloads/data/sources.json`` (``workloads.datasets``).

``mmcache data list`` names each public data set the replays read (source, licence, present or not); ``mmcache data
fetch [NAME ...]`` downloads them into the data folder. Unknown names and an unreadable manifest fail before anything
is fetched (2); a failed download or a source made by hand whose folder is missing is 1; Ctrl-C is 130, the files
fetched staying.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from workloads import registry
from workloads.commands.common import INTERRUPTED, fail


def add_parser(sub) -> None:
    """``mmcache data list|fetch`` and their options."""
    dp = sub.add_parser("data", help="list the public data sets the replays read, or fetch them into the data folder",
                        description="List the public data sets the replays and benchmarks read (source, licence, "
                        "whether present), or download them into the data folder with progress, resume and the "
                        "checks the manifest has (size, sha256).")
    actions = dp.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    for name, what in (("list", "each source, its licence and whether its files are present"),
                       ("fetch", "download the sources named (default: all) into the data folder")):
        ap = actions.add_parser(name, help=what, description=what)
        if name == "fetch":
            ap.add_argument("names", nargs="*", metavar="NAME", help="sources to fetch (default: every source with "
                            "files to download; a source made by hand says how to make it, and the command fails "
                            "until its folder is there)")
            ap.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
        ap.add_argument("--data", metavar="PATH", help=f"the data folder (default: {registry.default_data_words()}): "
                        "where the replays look by default")
        ap.add_argument("--manifest", type=Path, metavar="FILE", help="a sources manifest other than the one shipped "
                        "(workloads/data/sources.json)")


def data_command(args) -> int:
    """``mmcache data list|fetch``; unknown names and an unreadable manifest fail before anything is fetched."""
    from workloads import datasets
    try:
        sources = datasets.load_sources(args.manifest)
    except datasets.DataError as e:
        return fail(str(e))
    root, how = registry.data_place(args.data)
    if args.data_command == "list":
        for s in sources.values():
            present = sum((root / f.path).is_file() for f in s.files)
            state = (f"{present} of {len(s.files)} files present" if s.files else
                     f"made by hand, folder {'present' if (root / s.name).is_dir() else 'missing'} "
                     f"(mmcache data fetch {s.name} says how)")
            print(f"{s.name:15} {s.what}\n{'':15} read by {s.read_by}; licence {s.licence}; {s.home}; {state}")
        print(f"data folder: {root} (from {how})")
        return 0
    if unknown := [n for n in args.names if n not in sources]:
        return fail(f"unknown data source {unknown[0]!r}; known: {', '.join(sources)}")
    if problem := _data_folder_problem(root):
        return fail(f"data folder {root} (from {how}): {problem}")
    by_hand = [n for n, s in sources.items() if not s.files]
    chosen = args.names or [n for n in sources if n not in by_hand]  # by default, every source there is to download
    progress = not args.no_progress and sys.stderr.isatty()
    try:
        missing = datasets.fetch([sources[n] for n in chosen], root, progress)
    except datasets.DataError as e:
        print(f"mmcache: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mmcache: interrupted (Ctrl-C) while fetching: the files fetched stay; run the command again to "
              "resume the one in progress", file=sys.stderr)
        return INTERRUPTED
    if not args.names and by_hand:
        print(f"not fetched by default, made by hand: {', '.join(by_hand)} (mmcache data fetch NAME says how)")
    where = "replays read it by default" if how != "--data" else f"replays read it with --data {root}"
    print(f"data folder: {root} (from {how}); {where}")
    if missing:
        print(f"mmcache: error: nothing fetched for {', '.join(missing)}: made by hand, and the folder is missing "
              f"(see above for how to make it in {root})", file=sys.stderr)
        return 1
    return 0


def _data_folder_problem(root: Path) -> str | None:
    """Why files cannot be put under ``root`` (the folders missing on the way are made), or None."""
    if root.exists():
        return None if root.is_dir() and os.access(root, os.W_OK | os.X_OK) else "not a writable folder"
    parent = root.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be made: {parent} is not a writable folder"
    return None

