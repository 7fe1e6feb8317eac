"""``weights_fingerprint``: the name of what a torch module computes, taken from the checkpoint files its weights were
loaded from instead of from the weights: its cost grows with the number of tensors, not their size. The default of
``mmcache.hf`` and ``mmcache.mstar``; ``module_fingerprint`` (every byte) where no checkpoint names the weights.

After the module's class, canonical config and attention backend (as ``module_fingerprint``) and the identity of
each checkpoint folder it names a tensor from (every file of it, configs and preprocessing files included: see
``mmcache.checkpoint_files``), each state-dict tensor is named, in state-dict order, one of three ways:

- the alias of an earlier entry when it is the same memory (tied weights);
- a file reference (the file's identity, the tensor's key there, the module's dtype) when a tensor of the folder's
  weight files matches it by name (up to a prefix, e.g. M*'s ``audio_encoder.`` for ``model.encoder.``), shape and
  dtype (or a float dtype the module converted to), and a sample of it equals the file: a window at each end and two
  inside, ``WINDOW`` elements each, compared after the same conversion. The sample is what tells weights loaded from
  the file from a module built from the folder's config and initialised or loaded otherwise (random init, another
  checkpoint): those differ from the file at every element, so in the sample;
- its bytes, as ``module_fingerprint`` hashes them, otherwise (buffers, new heads, renamed or fused weights).

Invariant: equal fingerprints give equal outputs, as for ``module_fingerprint``, except for what a sample and file
identities cannot see; a caller who may meet these passes ``fingerprint=`` instead:

- weights changed in memory after loading, or a folder rewritten between loading and the fingerprint, where only
  elements outside the sample changed (a single edited weight keeps the file's name);
- weights loaded from a variant or another format in the same folder (``model.fp16.safetensors`` beside
  ``model.safetensors``) whose elements agree with the default file's in the sample but differ elsewhere;
- the file-identity limits of ``mmcache.checkpoint_files`` (a file rewritten in place within one clock tick).

When no tensor can be named by file, the fingerprint is ``module_fingerprint``'s, the same string. Stable across
restarts and, for hub cache snapshots (named by their content-addressed blobs), across machines; a local folder is
named by its files' stat, so a copy on another machine is another checkpoint (a needless miss).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
import xxhash
from torch import nn

from digests.digest import hasher
from mmcache.checkpoint_files import Folder, Tensor, read_folder, resolve_folder
from mmcache.encoder_key import stable_bytes
from mmcache.module_fingerprint import check_materialized, config_bytes, label, module_fingerprint, update_with_tensor

WINDOW = 8  # elements per sampled window
_CONVERTIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def weights_fingerprint(module: nn.Module, *, folders: Iterable[str | os.PathLike] = (),
                        cache_dir: str | os.PathLike | None = None) -> str:
    """``Class/hash/dtype/device type`` naming what ``module`` computes (see the module doc), from the checkpoint
    folders in ``folders`` (paths, or hub repo ids resolved in the hub cache ``cache_dir``) and those its configs
    name (``config._name_or_path`` of it and its submodules, as ``from_pretrained`` sets it). A tensor on the meta
    device raises ValueError."""
    state = module.state_dict()
    for name, t in state.items():
        check_materialized(name, t, module)
    found = [f for f in (read_folder(r) for r in checkpoint_roots(module, folders, cache_dir)) if f is not None]
    matched = _by_name(state, found) if found else {}
    refs = _sampled_equal(state, {name: ref for name, (_, ref) in matched.items()})
    if not refs:
        return module_fingerprint(module)
    h = hasher()
    h.update(stable_bytes(("mmcache.weights_fingerprint", 1)))
    h.update(config_bytes(module))
    for fi in sorted({matched[name][0] for name in refs}):
        h.update(stable_bytes(("folder", found[fi].identity)))
    first: dict[tuple, str] = {}
    for name, t in state.items():
        memory = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() and memory in first:
            h.update(stable_bytes(("alias", name, first[memory])))
            continue
        first.setdefault(memory, name)
        ref = refs.get(name)
        if ref is not None:
            h.update(stable_bytes(("file", name, str(t.dtype), tuple(t.shape), ref.identity, ref.key,
                                   str(ref.dtype))))
        else:
            h.update(stable_bytes(("bytes",)))
            update_with_tensor(h, name, t, module)
    return label(module, h.hexdigest())


def checkpoint_roots(module: nn.Module, folders: Iterable[str | os.PathLike] = (),
                     cache_dir: str | os.PathLike | None = None) -> list[Path]:
    """The local checkpoint folders ``folders`` and ``module``'s configs name, each once, in that order."""
    names = list(folders)
    for m in module.modules():
        config = getattr(m, "config", None)
        name = getattr(config, "_name_or_path", None)
        if name is None and isinstance(config, Mapping):  # diffusers' FrozenDict config
            name = config.get("_name_or_path")
        if name:
            names.append(name)
    roots: list[Path] = []
    for name in names:
        root = resolve_folder(name, cache_dir)
        if root is not None and root not in roots:
            roots.append(root)
    return roots


def _by_name(state: dict, folders: list[Folder]) -> dict[str, tuple[int, Tensor]]:
    """State-dict name -> (index in ``folders``, the file tensor of the same name up to a prefix, shape and a dtype
    it can have been loaded as). Each name takes its longest dotted suffix some file key ends with; of the prefix
    rewrites that suffix allows (module prefix -> folder, directory and key prefix), the one most names agree on; a
    tie names nothing."""
    names = [n for n, t in state.items() if t.numel()]
    wanted = {n[i:] for n in names for i in _dots(n)}
    index: dict[str, list[tuple]] = {}
    real, seen = {}, set()  # a file two folders hold (a subfolder named too) is indexed once, under the first
    for fi, folder in enumerate(folders):
        for directory, tensors in folder.weights.items():
            for key, tensor in tensors.items():
                file = real.setdefault(tensor.path, os.path.realpath(tensor.path))
                if (file, key) in seen:
                    continue
                seen.add((file, key))
                for i in _dots(key):
                    if key[i:] in wanted:
                        index.setdefault(key[i:], []).append((fi, directory, key[:i], tensor))
    options: dict[str, list[tuple[tuple, Tensor]]] = {}
    for n in names:
        t = state[n]
        for i in _dots(n):
            if n[i:] in index:
                options[n] = [((n[:i], fi, d, prefix), (fi, tensor)) for fi, d, prefix, tensor in index[n[i:]]
                              if tensor.shape == tuple(t.shape) and _loadable(tensor.dtype, t.dtype)]
                break
    support = Counter(rewrite for opts in options.values() for rewrite, _ in opts)
    chosen = {}
    for n, opts in options.items():
        ranked = sorted(opts, key=lambda o: -support[o[0]])
        if ranked and (len(ranked) == 1 or support[ranked[0][0]] > support[ranked[1][0]]):
            chosen[n] = ranked[0][1]
    return chosen


def _dots(name: str) -> list[int]:
    """Where the dotted suffixes of ``name`` start, longest first."""
    return [0] + [i + 1 for i, c in enumerate(name) if c == "."]


def _loadable(stored: torch.dtype, loaded: torch.dtype) -> bool:
    return stored == loaded or stored in _CONVERTIBLE and loaded in _CONVERTIBLE


def _windows(key: str, numel: int) -> list[tuple[int, int]]:
    """The sampled element ranges of a tensor: all of a small one, else a window at each end and two inside at
    places fixed by its key (the same in every process)."""
    if numel <= 4 * WINDOW:
        return [(0, numel)]
    span = numel - WINDOW
    inside = [xxhash.xxh3_64_intdigest(f"{key}\0{i}".encode()) % span for i in (1, 2)]
    return [(s, s + WINDOW) for s in (0, span, *inside)]


def _sampled_equal(state: dict, refs: dict[str, Tensor]) -> dict[str, Tensor]:
    """The references whose sampled elements equal the module's, the file's converted to the module's dtype. The
    module's samples travel to host in one copy per device."""
    pieces: dict[torch.device, list[torch.Tensor]] = {}
    plan = []
    for name, ref in refs.items():
        t = state[name].detach()
        flat = t.reshape(-1)
        windows = _windows(ref.key, flat.numel())
        views = [flat[a:b].view(torch.uint8) for a, b in windows]
        pieces.setdefault(t.device, []).extend(views)
        plan.append((name, ref, t.dtype, windows, t.device, sum(v.numel() for v in views)))
    host = {device: memoryview(torch.cat(views).cpu().numpy().tobytes()) for device, views in pieces.items()}
    at = dict.fromkeys(host, 0)
    equal, files = {}, {}
    try:
        for name, ref, dtype, windows, device, size in plan:
            mine = host[device][at[device]:at[device] + size]
            at[device] += size
            theirs = b"".join(ref.read(a, b, files) for a, b in windows)
            if ref.dtype != dtype:
                theirs = torch.frombuffer(bytearray(theirs), dtype=ref.dtype).to(dtype).view(torch.uint8).numpy() \
                    .tobytes()
            if mine == theirs:
                equal[name] = ref
    except OSError:  # a weight file changed or vanished under us: name nothing by file
        return {}
    finally:
        for f in files.values():
            f.close()
    return equal
