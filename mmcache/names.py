"""Page names: a 64-bit xxh64 chain over full pages, rooted at the process fingerprint.

``name_i = xxh64(tokens of page i ‖ media of page i, seed=name_{i-1})`` with ``name_{-1}`` the chain root:
``xxh64(fingerprint)`` for an empty salt, else ``xxh64(salt, seed=xxh64(fingerprint))``. Passing the parent as the
seed commits to it exactly as prefixing its 8 bytes would, at one hash call per page. Nothing here takes a lock or
touches a pool, so engines compute names before entering the cache.

A name only nominates a page; the cache confirms it with the verifying ids (tokens, media, parent, salt).
"""

from __future__ import annotations

import array
import dataclasses
import json
from functools import cached_property
from typing import Iterable, Sequence

import numpy as np
import xxhash

from mmcache.checks import as_names
from mmcache.errors import InvalidRequest

TOKEN_DTYPE = np.int32
_TOKEN_LIMIT = np.iinfo(TOKEN_DTYPE).max
# Up to this many ids, a list's range check runs in Python: an engine names prompts between forwards, when numpy's
# reductions run cold (~50 us for a max), where Python's max over a few thousand ints costs less.
_LIST_CHECKED = 4096
_NO_MEDIA = np.zeros((4096, 2), dtype=np.uint64)  # media_ids of pages without media (read-only)
_NO_MEDIA.flags.writeable = False


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """The process constants that KV bytes depend on; any change gives a different chain root.

    ``model`` should identify the weights exactly (repository@revision, or a hash of the files).
    """

    model: str
    tp_rank: int = 0
    tp_size: int = 1
    kv_dtype: str = "bfloat16"
    attention_backend: str = "sdpa"
    page_size: int = 128
    extra: str = ""

    def __post_init__(self):
        object.__setattr__(self, "kv_dtype", str(self.kv_dtype).removeprefix("torch."))
        if int(self.page_size) <= 0:
            raise InvalidRequest(f"page_size must be positive, got {self.page_size}")

    @cached_property
    def root(self) -> int:
        """The 64-bit chain root: xxh64 of the fields as canonical JSON."""
        canonical = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"), default=str)
        return xxhash.xxh64_intdigest(canonical.encode())


def chain_root(fp: Fingerprint, salt: bytes = b"") -> int:
    """The root a request's chain starts from: the fingerprint's, with the tenant salt folded in."""
    if not isinstance(salt, (bytes, bytearray)):
        raise InvalidRequest(f"salt must be bytes, got {type(salt).__name__}")
    return xxhash.xxh64_intdigest(bytes(salt), seed=fp.root) if salt else fp.root


def as_tokens(token_ids, limit: int = _TOKEN_LIMIT) -> np.ndarray:
    """Token ids as a contiguous int32 array; raises ``InvalidRequest`` unless all are integers in [0, limit).

    One prompt is 1-D; a batch of one (shape ``(1, n)``, as tokenizers return ``input_ids``) is taken as its row.
    Any other shape (a scalar, several rows, ragged nesting) is refused rather than flattened into one prompt.
    """
    if type(token_ids) is list and token_ids and type(token_ids[0]) is not bool:
        try:  # array('I') (4-byte unsigned) converts a list ~25% faster than numpy and refuses a negative id; anything
            ids = array.array("I", token_ids)  # it refuses takes the general path
        except (TypeError, OverflowError):
            pass
        else:
            # The upper bound of a short list is checked by Python's max over the list itself (see above; over the
            # array, every id would become an int object again), of a long one by numpy's.
            top = max(token_ids) if len(ids) <= _LIST_CHECKED else int(np.frombuffer(ids, dtype=np.uint32).max())
            if top >= (1 << 31 if limit >= _TOKEN_LIMIT else limit):
                raise InvalidRequest(f"token ids must lie in [0, {limit}), got range [{min(token_ids)}, {top}]")
            return np.frombuffer(ids, dtype=TOKEN_DTYPE)
    elif hasattr(token_ids, "detach"):  # torch tensor, without importing torch here
        token_ids = token_ids.detach().cpu().numpy()
    try:
        arr = np.asarray(token_ids)
    except ValueError as e:  # ragged nesting
        raise InvalidRequest(f"token ids must be one flat sequence: {e}") from None
    if arr.ndim != 1:
        if arr.ndim != 2 or arr.shape[0] != 1:
            raise InvalidRequest(f"token ids must be 1-D (or one row of shape (1, n)), got shape {arr.shape}")
        arr = arr[0]
    if arr.size and (arr.dtype.kind not in "iu"):
        raise InvalidRequest(f"token ids must be integers, got dtype {arr.dtype}")
    # int32 ids are checked in one pass: read as uint32, a negative id is 2**31 or more, above every bound (and every
    # int32 id is below a limit of the int32 maximum or more).
    if arr.dtype == TOKEN_DTYPE:
        bad = arr.size and int(arr.view(np.uint32).max()) >= (1 << 31 if limit >= _TOKEN_LIMIT else limit)
    else:
        bad = arr.size and (int(arr.min()) < 0 or int(arr.max()) >= limit)
    if bad:
        raise InvalidRequest(f"token ids must lie in [0, {limit}), got range [{arr.min()}, {arr.max()}]")
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)


def digest_as_bytes(digest) -> bytes:
    """A media digest in the one form names and tables hash: an int in [0, 2**128) as its 16 little-endian bytes,
    anything else as ``bytes(digest)`` (never empty); ``InvalidRequest`` for what is neither."""
    if isinstance(digest, int) and not isinstance(digest, bool):
        if digest < 0 or digest >= 1 << 128:
            raise InvalidRequest("an integer media digest must be in [0, 2**128)")
        return digest.to_bytes(16, "little")
    if isinstance(digest, (bool, str)):
        raise InvalidRequest(f"a media digest must be bytes, an int or support bytes(), got {type(digest).__name__}")
    try:
        value = bytes(digest)
    except TypeError:
        raise InvalidRequest(f"a media digest must be bytes, an int or support bytes(), "
                             f"got {type(digest).__name__}") from None
    if not value:
        raise InvalidRequest("a media digest must not be empty")
    return value


def media_by_page(media: Iterable, page_size: int, num_tokens: int) -> dict[int, bytes]:
    """Group ``(offset, digest)`` marks by the page of their first placeholder: page -> ``offset ‖ digest`` blob.

    Offsets within the page enter the blob so that two images swapped inside one page give different names.
    """
    pages: dict[int, list[tuple[int, bytes]]] = {}
    for mark in media or ():
        try:
            offset, digest = mark
        except (TypeError, ValueError):
            raise InvalidRequest(f"a media mark must be an (offset, digest) pair, got {mark!r}")
        if not isinstance(offset, (int, np.integer)) or isinstance(offset, bool) or not 0 <= offset < num_tokens:
            raise InvalidRequest(f"media offset {offset!r} outside the prompt of {num_tokens} tokens")
        pages.setdefault(int(offset) // page_size, []).append((int(offset), digest_as_bytes(digest)))
    return {p: b"".join(o.to_bytes(8, "little") + d for o, d in sorted(marks)) for p, marks in pages.items()}


def media_ids(blobs: dict[int, bytes], pages: range) -> np.ndarray:
    """The 128-bit media verifying id of each page in ``pages`` (zero where the page holds no media), as a read-only
    [len(pages), 2] uint64 array: a slice of one shared zero block when none of the pages holds media (an engine names
    and commits between forwards, when allocating zeros runs cold)."""
    if len(pages) <= len(_NO_MEDIA) and not any(p in pages for p in blobs):
        return _NO_MEDIA[:len(pages)]
    out = np.zeros((len(pages), 2), dtype=np.uint64)
    for p, blob in blobs.items():
        if p in pages:
            out[p - pages.start] = np.frombuffer(xxhash.xxh3_128_digest(blob), dtype=np.uint64)
    out.flags.writeable = False
    return out


def chain(parent: int, tokens: np.ndarray, page_size: int, first_page: int = 0,
          media: dict[int, bytes] | None = None) -> list[int]:
    """Names of the full pages of ``tokens`` (int32), continuing a chain whose last name is ``parent``.

    ``first_page`` is the page number of ``tokens[0]`` in the whole sequence, so media marks keyed by absolute page
    fall on the right pages. Trailing tokens that do not fill a page get no name.
    """
    n_pages = len(tokens) // page_size
    parent = int(parent)  # a caller's name may be a numpy integer; the xxh64 seed must be an int
    step = page_size * tokens.itemsize
    buf = memoryview(tokens).cast("B")  # no slice of the array: the loop reads its full pages only
    hash64 = xxhash.xxh64_intdigest
    names = [0] * n_pages
    if not media:
        for i in range(n_pages):
            parent = names[i] = hash64(buf[i * step:(i + 1) * step], parent)
        return names
    for i in range(n_pages):
        blob = media.get(first_page + i)
        page = buf[i * step:(i + 1) * step]
        parent = names[i] = hash64(bytes(page) + blob if blob else page, parent)
    return names


def token_bytes(tokens: np.ndarray) -> memoryview:
    """int32 token ids (flat, or one page a row) as one flat byte view without a numpy call when they are contiguous
    int32 already: page ``i``'s ids are bytes ``[i * step, (i + 1) * step)`` for ``step = 4 * page_size``."""
    view = memoryview(tokens)
    if not view.c_contiguous or view.itemsize != 4:
        view = memoryview(np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE))
    return view.cast("B")


def chain_children(parents: Sequence[int], rows: np.ndarray) -> list[int]:
    """The name of one page (no media) after each of ``parents``: ``chain(parents[j], rows[j], page_size)[0]`` for
    every row of the int32 ``rows`` [n, page_size], in one pass."""
    step = rows.shape[1] * 4
    buf = token_bytes(rows)
    hash64 = xxhash.xxh64_intdigest
    return [hash64(buf[j * step:(j + 1) * step], int(parent)) for j, parent in enumerate(parents)]


def page_names(fp: Fingerprint, token_ids, media: Sequence = (), salt: bytes = b"") -> list[int]:
    """One 64-bit name per full page of ``token_ids``; needs no lock and no pool."""
    tokens = as_tokens(token_ids)
    blobs = media_by_page(media, fp.page_size, len(tokens))
    return chain(chain_root(fp, salt), tokens, fp.page_size, 0, blobs)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class NamedPrompt:
    """A prompt named for the page chain: int32 token ids, media blobs by page, the salt and the chain root it folds
    into the fingerprint's, and the names of its full pages. Built once per request, before any lock is taken; the
    index, the shadow table and the M* allocator all name, match and index from one.

    Invariant: ``names`` are the chain of ``tokens`` from ``root`` (or names a caller computed for them, checked to be
    one uint64 per full page), so a page's name commits to every token and media mark up to its end.
    """

    tokens: np.ndarray
    media: dict[int, bytes]
    salt: bytes
    root: int
    names: list[int]
    page_size: int

    @classmethod
    def build(cls, fp: Fingerprint, token_ids, media: Sequence = (), salt: bytes = b"",
              names: Sequence[int] | None = None, *, vocab_limit: int = _TOKEN_LIMIT,
              what: str = "request") -> NamedPrompt:
        """Check and name a prompt; ``InvalidRequest`` (naming ``what``) for an empty or malformed one."""
        tokens = as_tokens(token_ids, vocab_limit)
        if tokens.size == 0:
            raise InvalidRequest(f"{what}: a prompt needs at least one token")
        P = fp.page_size
        root = chain_root(fp, salt)
        blobs = media_by_page(media, P, tokens.size)
        names = chain(root, tokens, P, 0, blobs) if names is None else as_names(names, tokens.size // P, what)
        return cls(tokens, blobs, bytes(salt), root, names, P)

    def matchable(self, rows_left: int = 1) -> int:
        """Full pages a lookup may match: as many as leave at least ``rows_left`` prompt tokens to compute (never the
        page of the last prompt token, whose logits the model needs)."""
        return max(0, (self.tokens.size - max(1, rows_left)) // self.page_size)

    def media_ids(self, pages: int) -> np.ndarray:
        """The 128-bit media verifying ids of the first ``pages`` pages."""
        return media_ids(self.media, range(pages))

    def written_pages(self, generated: np.ndarray, written_tokens: int) -> tuple[list[int], np.ndarray, np.ndarray]:
        """``(names, tokens [m, page_size], media ids [m, 2])`` of the full pages of prompt + ``generated`` (int32)
        among the first ``written_tokens`` tokens: what teardown may index. Past the prompt the chain continues from
        its last full page."""
        P = self.page_size
        seq = np.concatenate((self.tokens, generated)) if generated.size else self.tokens
        m = min(seq.size, written_tokens) // P
        names = self.names[:m]
        if m > len(names):
            start = len(names)
            names = names + chain(names[-1] if names else self.root, seq[start * P:m * P], P, start, self.media)
        return names, seq[:m * P].reshape(m, P), self.media_ids(m)
