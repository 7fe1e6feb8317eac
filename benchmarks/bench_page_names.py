"""Page naming: mmcache's xxh64 chain (``page_names`` / ``chain``) against vLLM's block-hash options, measured in the
same process on the same tokens, from a numpy int32 array and from a Python list.

vLLM names a full block ``hash_fn((parent_hash, tuple(block tokens), extra_keys))``; its options (vllm/utils/hashing.py,
``--prefix-caching-hash-algo``): ``sha256`` (SHA-256 over a pickle), ``sha256_cbor`` (over canonical CBOR), and in
later releases ``xxhash`` / ``xxhash_cbor`` (xxh3-128 over pickle / CBOR). The issue also asks for xxHash over
msgpack, which vLLM uses on its wire, the transformers engine's blake2b-64 (its prompts are lists, so from numpy
it pays one ``tolist()``), and M* main's native prefix cache: two SHA-256 per page (its page key, then the key
fingerprinted under the root), unverified. From numpy, each baseline pays ``tolist()`` per block, as vLLM would.

Figures: tokens/s, median over ``--repeat`` runs with the min-max spread, and each baseline's ratio to mmcache from
the same input kind. Run: python benchmarks/bench_page_names.py [--tokens 1000000] [--page-size 16]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pickle
import platform
import statistics
import sys
import time
from pathlib import Path

import cbor2
import msgpack
import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmcache import Fingerprint, page_names  # noqa: E402
from mmcache.names import chain, chain_root  # noqa: E402

SCHEMES = {
    "SHA-256 / pickle (vLLM sha256, default)": lambda x: hashlib.sha256(pickle.dumps(x, pickle.HIGHEST_PROTOCOL)),
    "SHA-256 / CBOR (vLLM sha256_cbor)": lambda x: hashlib.sha256(cbor2.dumps(x, canonical=True)),
    "xxh3-128 / pickle (vLLM xxhash)": lambda x: xxhash.xxh3_128(pickle.dumps(x, pickle.HIGHEST_PROTOCOL)),
    "xxh3-128 / CBOR (vLLM xxhash_cbor)": lambda x: xxhash.xxh3_128(cbor2.dumps(x, canonical=True)),
    "xxh3-128 / msgpack": lambda x: xxhash.xxh3_128(msgpack.packb(x)),
}


def vllm_chain(tokens, page: int, hasher) -> list[bytes]:
    """One name per full block: ``hasher((parent, tuple(block), None)).digest()`` chained from an empty parent.
    ``tokens`` is a list, or a numpy array sliced then ``tolist()``-ed per block."""
    parent, out = b"", []
    to_tuple = (lambda b: tuple(b.tolist())) if isinstance(tokens, np.ndarray) else tuple
    for i in range(len(tokens) // page):
        parent = hasher((parent, to_tuple(tokens[i * page:(i + 1) * page]), None)).digest()
        out.append(parent)
    return out


def mstar_main_chain(tokens: np.ndarray, page: int, root: bytes) -> list[bytes]:
    """M* main's native prefix cache as its issue describes it: two SHA-256 per page, the page key over the parent
    key, the page's token bytes and its layout items (none here), then the key fingerprinted under the root. No
    verification follows: a collision of either serves another prefix's KV."""
    parent, out, sha = b"", [], hashlib.sha256
    for i in range(len(tokens) // page):
        parent = sha(parent + tokens[i * page:(i + 1) * page].tobytes()).digest()
        out.append(sha(root + parent).digest())
    return out


def transformers_chain(tokens, page: int, block_hash) -> list[int]:
    """The peer engine's chain (``match_prefix_blocks``): it slices the prompt list per block."""
    parent, out = None, []
    tokens = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
    for i in range(len(tokens) // page):
        parent = block_hash(parent, tokens[i * page:(i + 1) * page])
        out.append(parent)
    return out


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    P, n = args.page_size, args.tokens
    toks = np.random.default_rng(0).integers(0, 32000, size=n, dtype=np.int32)
    as_list = toks.tolist()
    fp = Fingerprint("bench/model@0", page_size=P)
    root = chain_root(fp)
    print(f"# machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, one thread; "
          f"Python {platform.python_version()}; {n:,} tokens, page {P}, {args.repeat} runs (median, min-max)")
    ours = {"numpy": timed(lambda: chain(root, toks, P), args.repeat),
            "list": timed(lambda: page_names(fp, as_list), args.repeat)}
    rows = [(f"mmcache xxh64 chain ({'chain' if k == 'numpy' else 'page_names'})", k, t, None)
            for k, t in ours.items()]
    for name, hasher in SCHEMES.items():
        for kind, src in (("numpy", toks), ("list", as_list)):
            t = timed(lambda: vllm_chain(src, P, hasher), args.repeat)
            rows.append((name, kind, t, statistics.median(t) / statistics.median(ours[kind])))
    t = timed(lambda: mstar_main_chain(toks, P, root.to_bytes(8, "little")), args.repeat)
    rows.append(("2x SHA-256 (M* main: page key, fingerprint)", "numpy", t,
                 statistics.median(t) / statistics.median(ours["numpy"])))
    try:  # the peer of bench_peer_transformers: blake2b-64 over parent + array('i', tokens), no verification
        from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash
    except ImportError:
        compute_block_hash = None
    for kind, src in (("numpy", toks), ("list", as_list)) if compute_block_hash else ():
        t = timed(lambda: transformers_chain(src, P, compute_block_hash), args.repeat)
        rows.append(("blake2b-64 (transformers CB)", kind, t, statistics.median(t) / statistics.median(ours[kind])))
    w = max(len(r[0]) for r in rows)
    print(f"{'naming':<{w}}  {'from':<6} {'M tokens/s (spread)':>24}  {'mmcache is':>10}")
    for name, kind, t, ratio in rows:
        rate = sorted(n / x / 1e6 for x in t)
        cell = f"{statistics.median(rate):.2f} ({rate[0]:.2f}-{rate[-1]:.2f})"
        print(f"{name:<{w}}  {kind:<6} {cell:>24}  {'' if ratio is None else f'{ratio:,.1f}x faster':>10}")


if __name__ == "__main__":
    main()
