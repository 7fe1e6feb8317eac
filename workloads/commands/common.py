"""What the ``mmcache`` commands share: exit statuses, one-line errors, option types, outputs, the metrics endpoint.

Exit statuses (``workloads.cli.main`` returns them): 0 on success; 2 on a usage, workload, model or trace error, or
a pool that cannot run, each refused before anything runs (``fail``); 1 when a run ran but did not succeed (an
output written to a fallback file, every request of a run failed, a download failed, a source made by hand missing);
``INTERRUPTED`` (130) after Ctrl-C, with what finished printed and written. Only argparse and torch-free modules are
imported here: the command line's ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from workloads.sizes import parse_size, parse_sizes

USAGE = 2  # a usage, workload, model or trace error, refused before anything runs
INTERRUPTED = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)
BYTE_UNITS = "k, M, G (binary: 1k = 1024 bytes; a trailing B is allowed, e.g. 256M, 2GB) or a plain number of bytes"


def token_sizes(text: str) -> list[int | None]:
    """A comma-separated list of sizes in tokens (``workloads.sizes.parse_sizes``), in the given order."""
    try:
        return parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def token_size(text: str) -> int:
    """One finite positive size in tokens (64k, 1M: binary units)."""
    sizes = token_sizes(text)
    if len(sizes) != 1 or sizes[0] is None or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"must be one finite positive size in tokens, got {text!r}")
    return sizes[0]


def byte_size(text: str) -> int:
    """A finite size in bytes, with binary units."""
    s = str(text).strip()
    try:
        value = parse_size(s[:-1] if s[-1:] in "bB" and s[-2:-1].isalpha() else s) if s else None
    except ValueError:
        value = -1
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}; it must be finite and positive, with "
                                         f"units {BYTE_UNITS}")
    return value


def byte_rate(text: str) -> float:
    """A transfer rate in bytes per second: a positive number (1.7e9) or a size per second (50G)."""
    try:
        value = float(text)
    except ValueError:
        value = float(byte_size(text))
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive rate in bytes/s, got {text!r}")
    return value


def positive_count(text: str) -> int:
    """A count of requests or sessions: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive whole number of requests/sessions, got {text!r}") \
            from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of requests/sessions, got {value}")
    return value


def nonnegative_seconds(text: str) -> float:
    """A finite number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


class CommandParser(argparse.ArgumentParser):
    """argparse with one-line errors: the message and where the usage is, not the whole usage first."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(message: str) -> int:
    """Say ``message`` as a one-line error; the usage status (``USAGE``) to return."""
    print(f"mmcache: error: {message}", file=sys.stderr)
    return USAGE


def save_output(flag: str, path: Path, data: bytes | str) -> bool:
    """Write one output (``workloads.output_files.save``): print where it went; False when it had to fall back."""
    from workloads.output_files import save
    where, problem = save(flag, path, data)
    print(f"wrote {where}" if problem is None else f"mmcache: error: {problem}", file=sys.stderr if problem else None)
    return problem is None


def report_held_interrupt() -> None:
    """Say that Ctrl-C came while the results were printed and written (``hold_interrupts``)."""
    print("mmcache: interrupted (Ctrl-C) while the results were written; they were written in full first",
          file=sys.stderr)


def given_flags(args, defaults: dict, dests) -> list[str]:
    """The options among ``dests`` set to something other than their default, as flags."""
    return ["--" + d.replace("_", "-") for d in dests if getattr(args, d) != defaults[d]]


def output_problem(args) -> str | None:
    """Why one of the output files (--json, --plot, --html) cannot be written, checked before any work runs."""
    for flag in ("json", "plot", "html"):
        path = getattr(args, flag, None)
        if path is None:
            continue
        folder = path.parent if str(path.parent) else Path(".")
        if path.is_dir():
            return f"--{flag} {path}: is a folder, not a file"
        if not folder.is_dir():
            return f"--{flag} {path}: folder {folder} does not exist"
        if path.exists() and not os.access(path, os.W_OK):
            return f"--{flag} {path}: the file exists and this user may not write it"
        if not os.access(folder, os.W_OK | os.X_OK):
            return f"--{flag} {path}: this user may not create files in folder {folder}"
    return None


def missing_dependency(args) -> str | None:
    """Why an output or endpoint asked for cannot be made with what is installed, checked before any work runs."""
    from mmcache.errors import MissingDependency
    from mmcache.extras import require
    try:
        for flag, module in (("plot", "matplotlib"), ("html", "matplotlib"), ("metrics_port", "prometheus_client")):
            if getattr(args, flag, None) is not None:
                require("replay", "--" + flag.replace("_", "-"), module)
    except MissingDependency as e:
        return str(e)
    return None


def progress_bars(args) -> bool:
    """Progress bars on stderr: on a terminal unless --no-progress; when off, the model libraries' bars go too."""
    from workloads.harness.progress import bars_available, quiet_third_party
    on = not args.no_progress and sys.stderr.isatty()
    if on and not bars_available():
        from mmcache.extras import install_hint
        print(f"note: no progress bars (tqdm is missing: {install_hint('replay')})", file=sys.stderr)
        on = False
    if not on:
        quiet_third_party()
    return on


def metrics_problem(args) -> str | None:
    """Why ``--metrics-port``/``--metrics-linger`` cannot be served as given."""
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        return f"--metrics-port must be in [0, 65535], got {args.metrics_port}"
    if args.metrics_linger is not None and args.metrics_port is None:
        return "--metrics-linger: needs --metrics-port (there is no metrics endpoint to keep up)"
    return None


def with_metrics(args, run, **kw) -> int:
    """``run(exporter, bound port)`` with ``--metrics-port`` served on loopback (``Exporter(**kw)``; ``None, None``
    without it), closed after; a port that cannot be bound fails before anything runs. The exporter starts before
    the slow part loads, so a scraper sees every series at 0 before the first request."""
    if args.metrics_port is None:
        return run(None, None)
    from workloads.harness.prometheus import Exporter
    exporter = Exporter(**kw)
    try:
        port = exporter.serve(args.metrics_port)
    except OSError as e:
        return fail(f"--metrics-port {args.metrics_port}: {e}")
    print(f"Prometheus metrics on http://127.0.0.1:{port}/metrics")
    try:
        return run(exporter, port)
    finally:
        exporter.close()


def linger_metrics(exporter, seconds: float, port: int) -> None:
    """Keep the metrics endpoint up ``seconds`` after the replay (Ctrl-C ends the wait)."""
    print(f"serving the final metrics on http://127.0.0.1:{port}/metrics for {seconds:g} s (Ctrl-C to stop)",
          flush=True)
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        pass
