"""The token cache: directories of raw numpy arrays, memory-mapped on read.

An entry lives at `<cache root>/<key>/` where the key hashes the corpus fingerprint, the
tokenizer hash and the preprocessing options; it holds one `<name>.bin` per array and a
`meta.json` (dtype and shape of each array, plus counts). Entries are written into a
`.tmp-*` directory and renamed into place only when complete, so an interrupted prepare never
leaves a half entry and concurrent writers (several ranks or nodes) cannot corrupt one: the
first rename wins and the others discard their copy. `cache_lock` serialises the processes of
one node that prepare the same cache root, so that one of them (the first, normally local rank 0)
tokenizes and the others wait and then open its entries instead of tokenizing the same data again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from lit_transformer.errors import DataError

CACHE_VERSION = 1  # bump when the layout or the tokenization rules change


def cache_root(cache_dir: str | None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("LIT_TRANSFORMER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lit_transformer"


@contextlib.contextmanager
def cache_lock(root: Path):
    """Hold an exclusive lock on `<root>/.lock` for the duration. The processes of one node that
    prepare data at once (every process under torchrun or srun: commands/train.py prepares before the
    Trainer, and so before any process group, exists) then build each entry once. A filesystem
    without locks (some network mounts) goes unlocked: the atomic rename still keeps entries whole."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX)
        except OSError:
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def cache_key(*parts) -> str:
    payload = json.dumps([CACHE_VERSION, *parts], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


class _ArrayFile:
    def __init__(self, path: Path, dtype, inner_shape: tuple):
        self.path, self.dtype, self.inner_shape = path, np.dtype(dtype), inner_shape
        self.file = open(path, "wb")
        self.rows = 0

    def append(self, values) -> None:
        arr = np.ascontiguousarray(values, dtype=self.dtype)
        if arr.shape[1:] != self.inner_shape:
            raise ValueError(f"{self.path.name}: rows of shape {arr.shape[1:]}, expected {self.inner_shape}")
        self.file.write(arr.tobytes())
        self.rows += arr.shape[0] if arr.ndim else 1

    def spec(self) -> dict:
        self.file.close()
        return {"dtype": self.dtype.name, "shape": [self.rows, *self.inner_shape]}


class CacheWriter:
    """Append arrays chunk by chunk, then `commit(meta)` renames the entry into place."""

    def __init__(self, root: Path, key: str):
        self.root, self.key = Path(root), key
        self.root.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=f".tmp-{key}-"))
        self.arrays: dict[str, _ArrayFile] = {}

    def array(self, name: str, dtype, inner_shape: tuple = ()) -> _ArrayFile:
        self.arrays[name] = _ArrayFile(self.tmp / f"{name}.bin", dtype, tuple(inner_shape))
        return self.arrays[name]

    def commit(self, meta: dict) -> CacheEntry:
        meta = dict(meta, arrays={name: a.spec() for name, a in self.arrays.items()}, version=CACHE_VERSION)
        with open(self.tmp / "meta.json", "w") as f:
            json.dump(meta, f, indent=1)
        final = self.root / self.key
        try:
            os.rename(self.tmp, final)
        except OSError:  # another process committed the same key first: keep theirs
            shutil.rmtree(self.tmp, ignore_errors=True)
        entry = open_cache(self.root, self.key)
        assert entry is not None
        return entry

    def abort(self) -> None:
        for a in self.arrays.values():
            a.file.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        return False


class CacheEntry:
    def __init__(self, path: Path, meta: dict):
        self.path, self.meta = path, meta
        self.arrays: dict[str, np.ndarray] = {}
        for name, spec in meta["arrays"].items():
            shape = tuple(spec["shape"])
            if shape[0] == 0:
                self.arrays[name] = np.empty(shape, dtype=spec["dtype"])
            else:
                self.arrays[name] = np.memmap(path / f"{name}.bin", dtype=spec["dtype"], mode="r", shape=shape)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]


def open_cache(root: Path, key: str) -> CacheEntry | None:
    """The committed entry for `key`, or None (a missing meta.json means not committed)."""
    path = Path(root) / key
    try:
        with open(path / "meta.json") as f:
            meta = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if meta.get("version") != CACHE_VERSION:
        return None
    return CacheEntry(path, meta)


def reopen_entry(path: str) -> CacheEntry:
    """The entry at `path` opened again (a dataset unpickled in a DataLoader worker)."""
    entry = open_cache(Path(path).parent, Path(path).name)
    if entry is None:
        raise DataError(f"token cache {path} disappeared while in use")
    return entry
