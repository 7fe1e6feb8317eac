"""Every error mmcache raises on bad input or exhausted capacity.

Each error is raised before any state changes, so catching one leaves the cache exactly as it was.
"""

# the root and the digests' errors live in the lowest layer (digests raise them); re-exported here with the rest
from digests.errors import InvalidMedia, InvalidRequest, MmcacheError  # noqa: F401


class OutOfPages(MmcacheError):
    """Live demand exceeds the pool: ``shortfall`` pages are missing even after evicting every cached page."""

    def __init__(self, shortfall: int, requested: int | None = None):
        self.shortfall = shortfall
        self.requested = requested
        wanted = f" of {requested} requested" if requested is not None else ""
        super().__init__(f"out of pages: {shortfall} page(s){wanted} missing after evicting all cached pages")


class PageOwnershipError(MmcacheError):
    """A retain of an unowned page or a release of a free page: the owner counts would be corrupted."""


class UnknownRequest(MmcacheError, KeyError):
    """A request id that was never admitted or has already ended."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown request"


class DuplicateRequest(MmcacheError):
    """A second admit of a request id that is still live."""



class InvalidCost(InvalidRequest):
    """A cost (the seconds a hit saves: an encoder output's ``compute_s``, a KV page's ``page_seconds``) that is not
    a finite number >= 0."""


class BrokenInvariant(MmcacheError, AssertionError):
    """A cache's ``check()`` found one of its rules broken (a bug, never bad input): the message names the rule."""


class InvalidConfig(MmcacheError, ValueError):
    """A setting that names nothing mmcache has, such as an unknown eviction policy."""


class TraceError(MmcacheError, ValueError):
    """A trace file or line that cannot be read; carries the file and 1-based line number."""

    def __init__(self, path, line: int | None, reason: str):
        self.path, self.line, self.reason = str(path), line, reason
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {reason}")


class EncoderOutputError(MmcacheError, ValueError):
    """An encoder output the store refuses: not tensors, or a shape/dtype other than expected or already stored."""



class AllocationFailed(OutOfPages):
    """An engine allocation for one request and label that live demand cannot meet: ``pages_short`` pages missing.

    Carries ``request_id`` and ``label`` on the exception itself, so a caller on another thread needs no shared state
    to tell which request to preempt.
    """

    def __init__(self, pages_short: int, request_id, label, requested: int | None = None):
        super().__init__(pages_short, requested)
        self.pages_short, self.request_id, self.label = pages_short, request_id, label
        self.args = (f"request {request_id!r}, label {label!r}: {self.args[0]}",)


class RefusedByGroup(MmcacheError):
    """Another rank of a tensor-parallel group could not admit or hold a request, so this rank undid it too
    (``mmcache.tp``); the rank that failed raises its own error."""


class MissingDependency(MmcacheError, ImportError):
    """A module an optional feature needs is not installed (or does not load beside this torch); the message is one
    line naming it and what to install (``mmcache.extras``)."""
