"""Embedded corpora and tasks built from the running interpreter's standard library source.

Nothing is downloaded: every machine that runs Python has these files, so tiny recipes and
tests train on real text offline.

- LM corpus: every `*.py` under `sysconfig.get_paths()["stdlib"]`, excluding `site-packages`
  and test directories (`test`, `tests`, `idle_test`); one document per file. A file goes to
  validation when a stable hash of its relative path falls in the lowest `val_fraction`
  (at least `MIN_VAL_FILES` files). On CPython 3.11: 734 files, 12.1 MB.
- Classification: function/class docstrings (via `ast`) labelled with the top-level package
  they come from, for `CLASSIFY_PACKAGES`; balanced by a per-class cap; split 70/15/15 by a
  stable hash of the docstring.
- Seq2seq: a function's docstring summary line -> the function's name.

The two tasks parse about 600 files with `ast` (about 4 s on one core). Each process needs them
(the token cache, the `choice` evaluation and the classify probe read them), so they are kept as
JSON in the token cache's folder (`$LIT_TRANSFORMER_CACHE` or ~/.cache/lit_transformer,
`stdlib-tasks/`), named by `task_fingerprint`: another Python's standard library is another file.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import sysconfig
import tempfile
from pathlib import Path

from lit_transformer.data.tokens.cache import cache_root

EXCLUDED_DIRS = ("site-packages", "test", "tests", "idle_test", "__pycache__")
MIN_VAL_FILES = 4
# Eight packages present in every CPython 3.10-3.13 with 160+ distinct docstrings each on 3.11
# (counted with ast: tkinter 722, asyncio 324, importlib 286, email 282, logging 235, xml 207,
# multiprocessing 200, unittest 164); their vocabularies differ ("widget", "coroutine", "MIME").
CLASSIFY_PACKAGES = ("asyncio", "email", "importlib", "logging", "multiprocessing", "tkinter", "unittest", "xml")
CLASSIFY_PER_CLASS = 160
SPLIT_FRACTIONS = {"train": 0.70, "validation": 0.15, "test": 0.15}
TASKS_VERSION = 1  # bump when the task definitions change, so token caches built from them miss


def task_fingerprint(kind: str) -> list:
    return [
        f"stdlib-{kind}",
        TASKS_VERSION,
        CLASSIFY_PACKAGES,
        CLASSIFY_PER_CLASS,
        SPLIT_FRACTIONS,
        corpus_fingerprint(0.0),
    ]


def stable_hash(text: str) -> int:
    """A 64-bit hash that does not change between processes (unlike `hash`)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def hash_fraction(text: str) -> float:
    return stable_hash(text) / 2.0**64


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def stdlib_files() -> tuple[tuple[str, Path], ...]:
    """(relative posix path, path) of every corpus file, sorted by relative path."""
    root = stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # prune: site-packages is large
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                out.append((path.relative_to(root).as_posix(), path))
    return tuple(sorted(out))


def corpus_split(split: str, val_fraction: float = 0.02) -> list[tuple[str, Path]]:
    """The files of the `train` or `validation` split, in a fixed (hash) order."""
    files = sorted(stdlib_files(), key=lambda item: stable_hash(item[0]))
    n_val = max(MIN_VAL_FILES, sum(hash_fraction(rel) < val_fraction for rel, _ in files))
    return files[:n_val] if split == "validation" else files[n_val:]


def corpus_texts(split: str, max_chars: int) -> list[str]:
    """The split's files as text, in order, until just past `max_chars` characters."""
    out, size = [], 0
    for _, path in corpus_split(split):
        text = path.read_text("utf-8", "replace")
        out.append(text)
        size += len(text)
        if size > max_chars:
            break
    return out


@functools.lru_cache(maxsize=4)
def corpus_fingerprint(val_fraction: float) -> str:
    """Content hash of the corpus: another Python version gives another cache key. Once per process:
    the installed standard library does not change under a running process, and every recipe read
    asks for it (734 files, about 15 ms of hashing each time)."""
    digest = hashlib.sha256(f"stdlib-corpus-v1 {val_fraction}".encode())
    for rel, path in stdlib_files():
        digest.update(rel.encode())
        digest.update(hashlib.sha1(path.read_bytes()).digest())
    return digest.hexdigest()


def _parse(path: Path):
    try:
        return ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):  # a file for another Python version: skip it
        return None


def _docstrings(package: str):
    """(relative path, qualified name, node, docstring) for each function/class with a docstring."""
    for rel, path in stdlib_files():
        if rel.split("/")[0] != package:
            continue
        tree = _parse(path)
        if tree is None:
            continue
        stack = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    qual = f"{prefix}{child.name}"
                    doc = ast.get_docstring(child, clean=True)
                    if doc:
                        yield rel, qual, child, doc
                    stack.append((child, qual + "."))


def _kept(kind: str, build) -> dict[str, list[dict]]:
    """build(), or its JSON kept from an earlier process. The file is written whole (a temporary
    file renamed); where the folder is not writable the examples are only built."""
    key = hashlib.sha256(json.dumps(task_fingerprint(kind)).encode()).hexdigest()[:16]
    path = cache_root(None) / "stdlib-tasks" / f"{kind}-{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    examples = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as file:
            json.dump(examples, file)
        os.replace(file.name, path)
    except OSError:
        pass
    return examples


@functools.lru_cache(maxsize=1)
def classification_examples() -> dict[str, list[dict]]:
    """{'train'|'validation'|'test': [{'text', 'label'}]}: balanced, deterministic."""
    return _kept("classify", _classification_examples)


@functools.lru_cache(maxsize=1)
def seq2seq_examples() -> dict[str, list[dict]]:
    """{'train'|'validation'|'test': [{'source': summary line, 'target': function name}]}."""
    return _kept("seq2seq", _seq2seq_examples)


def _classification_examples() -> dict[str, list[dict]]:
    by_label: dict[str, dict[str, None]] = {}
    owner: dict[str, set] = {}
    for package in CLASSIFY_PACKAGES:
        texts = {}
        for _, _, _, doc in _docstrings(package):
            if len(doc) >= 20:  # "Return self." says nothing about the package
                texts[doc] = None
                owner.setdefault(doc, set()).add(package)
        by_label[package] = texts
    per_class = min([CLASSIFY_PER_CLASS] + [len(t) for t in by_label.values()])
    splits: dict[str, list[dict]] = {name: [] for name in SPLIT_FRACTIONS}
    for package, texts in by_label.items():
        # a docstring shared by two packages has no single right label
        unique = sorted((t for t in texts if len(owner[t]) == 1), key=stable_hash)[:per_class]
        n_train = round(per_class * SPLIT_FRACTIONS["train"])
        n_val = round(per_class * SPLIT_FRACTIONS["validation"])
        parts = {
            "train": unique[:n_train],
            "validation": unique[n_train : n_train + n_val],
            "test": unique[n_train + n_val :],
        }
        for name, items in parts.items():
            splits[name].extend({"text": t, "label": package} for t in items)
    for name in splits:
        splits[name].sort(key=lambda ex: stable_hash(ex["text"]))
    return splits


def _seq2seq_examples() -> dict[str, list[dict]]:
    seen: dict[str, str] = {}
    # encodings/ is 120 generated codecs with the same docstrings
    packages = sorted({rel.split("/")[0] for rel, _ in stdlib_files() if "/" in rel} - {"encodings"})
    for package in packages:
        for _, _, node, doc in _docstrings(package):
            if isinstance(node, ast.ClassDef) or node.name.startswith("__"):
                continue
            summary = doc.strip().splitlines()[0].strip()
            if len(summary.split()) >= 3 and summary not in seen:
                seen[summary] = node.name
    splits: dict[str, list[dict]] = {"train": [], "validation": [], "test": []}
    for summary, name in sorted(seen.items(), key=lambda kv: stable_hash(kv[0])):
        f = hash_fraction("s2s " + summary)
        split = "validation" if f < 0.05 else "test" if f < 0.10 else "train"
        splits[split].append({"source": summary, "target": name})
    return splits
