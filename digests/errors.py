"""The errors the digests raise, and the root of every mmcache error (``mmcache.errors`` re-exports them).

They live here, in the lowest layer, so that digests import nothing from the packages above them while every error
of every layer still derives from one ``MmcacheError``.
"""


class MmcacheError(Exception):
    """Base of every mmcache error."""


class InvalidRequest(MmcacheError, ValueError):
    """Arguments that cannot describe a request: bad tokens, salt, names or lengths."""


class InvalidMedia(MmcacheError, ValueError):
    """Media, params or token ids that cannot be digested or decoded: missing file, unsupported type, corrupt data."""
