"""What a checkpoint folder holds, read without its weights: each file's identity and the tensor directory of the
weight files a loader reads, with reads of a few elements of any tensor.

A folder is a model directory as ``save_pretrained`` writes it or a Hugging Face hub cache snapshot: its files and
those of its immediate subfolders (diffusers' ``text_encoder/``, ``vae/``...), hidden ones left out. Invariant: a
file's identity changes whenever its bytes do, up to the limits below, and reading a folder never reads a weight:

- a hub cache file (a symlink into ``blobs/``) is named by its blob, the hash of its content (sha256 for weights,
  the git blob id for small files): equal on every machine that downloaded the same revision;
- a file of at most ``SMALL`` bytes (configs, preprocessor and tokenizer files, a tiny model's weights) by an
  xxh3-128 hash of its content;
- any other file by its real path, device, inode, size and modification and change times in nanoseconds. Not seen:
  a file rewritten in place within one tick of the file system's clock (a few ms on Linux, seconds on some network
  or FAT file systems) to the same size, after a process named the old bytes. It names the file on this machine:
  a copy elsewhere (or a moved folder) has another identity, a needless miss.

The weight files of a directory are those ``from_pretrained`` and M*'s loaders read by default: the safetensors
index without a variant (``model.safetensors.index.json``) and its shards, else the one safetensors file without a
variant (``model.safetensors``, ``diffusion_pytorch_model.safetensors``), else the same for ``.bin``/``.pt``/``.pth``
(read with ``torch.load(mmap=True)``, which maps the data without reading it). Variants (``model.fp16.safetensors``)
and other formats beside them are not weight files, only files with an identity.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from pathlib import Path

import torch

from digests.digest import hasher, update_from_file
from mmcache.encoder_key import stable_bytes

SMALL = 4 << 20  # files up to this size are named by their content
MAX_FILES = 4096  # a "folder" with more files than this is not a checkpoint (a home directory given as a path)
_FORMATS = (".safetensors", ".bin", ".pt", ".pth")  # in the order loaders prefer them
_DEFAULT_STEMS = ("model", "diffusion_pytorch_model", "pytorch_model")
_SHARD = re.compile(r"-\d+-of-\d+$")
_BLOB = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclasses.dataclass(frozen=True, eq=False)
class Tensor:
    """One tensor of a weight file: its key there, dtype, shape, and where its bytes lie (a byte offset in a
    safetensors file, or the memory-mapped tensor of a ``torch.load``)."""

    path: Path
    identity: bytes
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int | None = None
    mapped: torch.Tensor | None = None

    def read(self, start: int, stop: int, files: dict) -> bytes:
        """The raw bytes of elements ``start:stop`` (flat, in the file's dtype); reads only those. ``files``: the open
        files of this read (path -> file), filled here and closed by the caller."""
        if self.mapped is not None:
            return self.mapped.reshape(-1)[start:stop].contiguous().view(torch.uint8).numpy().tobytes()
        f = files.get(self.path)
        if f is None:
            f = files[self.path] = open(self.path, "rb")
        size = self.dtype.itemsize
        data = os.pread(f.fileno(), (stop - start) * size, self.offset + start * size)
        if len(data) != (stop - start) * size:
            raise OSError(f"{self.path} is shorter than its header says")
        return data


@dataclasses.dataclass(frozen=True)
class Folder:
    """A checkpoint folder: ``identity`` (of every file, by relative path) and ``weights``, per directory holding
    weight files (``""`` for the folder itself), the tensors of those files by key."""

    root: Path
    identity: bytes
    weights: dict[str, dict[str, Tensor]]


def read_folder(root: str | os.PathLike) -> Folder | None:
    """The checkpoint folder at ``root``, or None when it is not one (no weight files, unreadable, too many files)."""
    root = Path(root)
    try:
        files = _files(root)
        if files is None:
            return None
        identities = {rel: file_identity(path) for rel, path in files.items()}
        weights = {}
        for directory in sorted({rel.rpartition("/")[0] for rel in files}):
            names = {rel.rpartition("/")[2]: path for rel, path in files.items() if rel.rpartition("/")[0] == directory}
            tensors = _directory_tensors(names, {n: identities[(directory + "/" if directory else "") + n]
                                                 for n in names})
            if tensors:
                weights[directory] = tensors
    except (OSError, ValueError, KeyError, TypeError):  # a file vanished or is not what its name says: unnamed
        return None
    if not weights:
        return None
    h = hasher()
    for rel in sorted(identities):
        h.update(stable_bytes((rel, identities[rel])))
    return Folder(root, h.digest(), weights)


def resolve_folder(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The local folder ``name_or_path`` names: itself if a directory, else for a hub repo id the one snapshot the
    hub cache (``cache_dir``, else the default one) holds of it. None when there is none, or several: which
    revision was loaded is then unknown. Never downloads."""
    if not name_or_path:
        return None
    if os.path.isdir(name_or_path):
        return Path(os.path.abspath(name_or_path))
    name = str(name_or_path)
    if name.count("/") > 1 or name.startswith((".", "/")) or os.sep != "/" and os.sep in name:
        return None
    if cache_dir is None:
        try:
            from huggingface_hub.constants import HF_HUB_CACHE
        except ImportError:  # no hub client (mmcache's core needs none): nothing was loaded through its cache
            return None
        cache_dir = HF_HUB_CACHE
    snapshots = Path(cache_dir) / ("models--" + name.replace("/", "--")) / "snapshots"
    try:
        found = [p for p in snapshots.iterdir() if p.is_dir()]
    except OSError:
        return None
    return found[0] if len(found) == 1 else None


def file_identity(path: Path) -> bytes:
    """What names the bytes of ``path`` (see the module doc): its hub blob, its content when small, else its stat."""
    real = os.path.realpath(path)
    blob = Path(real)
    if os.path.islink(path) and blob.parent.name == "blobs" and _BLOB.match(blob.name):
        return b"blob:" + blob.name.encode()
    st = os.stat(real)
    if st.st_size <= SMALL:
        h = hasher()
        update_from_file(h, real)
        return b"content:" + h.digest()
    return stable_bytes(("stat", real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))


def _files(root: Path) -> dict[str, Path] | None:
    """Relative path -> path of the files of ``root`` and its immediate subfolders, hidden ones left out."""
    if not root.is_dir():
        return None
    files = {}
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        if entry.is_file():
            files[entry.name] = Path(entry.path)
        elif entry.is_dir():
            for sub in sorted(os.scandir(entry.path), key=lambda e: e.name):
                if not sub.name.startswith(".") and sub.is_file():
                    files[f"{entry.name}/{sub.name}"] = Path(sub.path)
                if len(files) > MAX_FILES:
                    return None
        if len(files) > MAX_FILES:
            return None
    return files


def _directory_tensors(names: dict[str, Path], identities: dict[str, bytes]) -> dict[str, Tensor]:
    """The tensors of one directory's weight files by key (see the module doc for which files); a key in two of
    them names neither."""
    for ext in _FORMATS:
        files = _weight_files(names, ext)
        if files is None:
            continue
        tensors, seen = {}, set()
        for name in files:
            read = _safetensors_header if ext == ".safetensors" else _torch_tensors
            for t in read(names[name], identities[name]):
                if t.key in seen:
                    tensors.pop(t.key, None)
                else:
                    tensors[t.key] = t
                seen.add(t.key)
        return tensors
    return {}


def _weight_files(names: dict[str, Path], ext: str) -> list[str] | None:
    """The weight files of format ``ext`` a loader reads in a directory of ``names``: [] when which is ambiguous,
    None when the directory has no file of that format (the next format is tried)."""
    if not any(n.endswith(ext) for n in names):
        return None
    indexes = [n for n in names if n.endswith(ext + ".index.json") and "." not in n[:-len(ext + ".index.json")]]
    if len(indexes) == 1:
        with open(names[indexes[0]]) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return shards if all(s in names for s in shards) else []
    plain = [n for n in names if n.endswith(ext) and "." not in n[:-len(ext)] and not _SHARD.search(n[:-len(ext)])]
    if len(plain) > 1:
        plain = [n for n in plain if n[:-len(ext)] in _DEFAULT_STEMS]
    return plain if len(plain) == 1 else []


def _safetensors_header(path: Path, identity: bytes) -> list[Tensor]:
    """The tensors a safetensors file declares, from its header alone (its first 8 + N bytes)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 1 << 28:
            raise ValueError(f"{path}: not a safetensors header")
        header = json.loads(f.read(n))
    out = []
    for key, info in header.items():
        dtype = _ST_DTYPES.get(info.get("dtype")) if key != "__metadata__" else None
        if dtype is None:
            continue
        shape, (begin, end) = tuple(info["shape"]), info["data_offsets"]
        if end - begin != dtype.itemsize * _numel(shape):
            continue
        out.append(Tensor(path, identity, key, dtype, shape, offset=8 + n + begin))
    return out


def _torch_tensors(path: Path, identity: bytes) -> list[Tensor]:
    """The tensors of a ``torch.save`` zip file, memory-mapped (nothing read but the pickle); [] for any other file."""
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:  # a legacy (non-zip) file, or not a state dict: its tensors stay unnamed
        return []
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict):
        return []
    return [Tensor(path, identity, k, v.dtype, tuple(v.shape), mapped=v) for k, v in loaded.items()
            if isinstance(k, str) and isinstance(v, torch.Tensor) and v.is_contiguous()]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
