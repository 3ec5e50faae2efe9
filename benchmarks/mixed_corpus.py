"""The large-corpus benchmarks' corpus: English (DATA_DIR/wikitext2/*.txt paragraphs,
DATA_DIR/*/*.en in runs of 20 lines), German (DATA_DIR/*_de_en/*.de, 20 lines a document) and
Python (the standard library's *.py files outside test and site-packages directories) as
blank-line separated documents, repeated with each copy's order shuffled up to a size, then
with invalid bytes inserted (benchmarks/large_corpus.py's docstring, step 1). Used by
large_corpus.py, data_store.py and shared_store.py.
"""

from __future__ import annotations

import os
import random
import re
import sysconfig
from pathlib import Path

LINES_PER_DOC = 20  # sentence-per-line files (news, Tatoeba): 20 consecutive lines make one document
EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")


def _utf8(path: Path) -> str | None:
    raw = path.read_bytes()
    if b"\x00" in raw or b"\r" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None  # only the injected bytes may be invalid


def _paragraphs(text: str) -> list[str]:
    return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]


def _line_documents(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if line.strip()]
    return ["\n".join(lines[i : i + LINES_PER_DOC]) for i in range(0, len(lines), LINES_PER_DOC)]


def source_documents(data_dir: Path) -> dict[str, list[bytes]]:
    """Documents (UTF-8, no blank line inside) by language."""
    docs: dict[str, list[str]] = {"english": [], "german": [], "python": []}
    for path in sorted(data_dir.glob("wikitext2/*.txt")):
        if path.name != "SOURCE.txt":
            docs["english"] += _paragraphs(path.read_text("utf-8"))
    for path in sorted(data_dir.glob("*/*.en")):
        docs["english"] += _line_documents(path.read_text("utf-8"))
    for path in sorted(data_dir.glob("*_de_en/*.de")):
        docs["german"] += _line_documents(path.read_text("utf-8"))
    root = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py") and (text := _utf8(Path(dirpath) / name)) is not None:
                docs["python"] += _paragraphs(text)
    if not docs["english"] or not docs["german"]:
        raise SystemExit(f"no English or German text under {data_dir} (wikitext2/, *_de_en/): see --data-dir")
    return {lang: [d.encode("utf-8") for d in items] for lang, items in docs.items()}


def build_corpus(data_dir: Path, workdir: Path, mb: float, invalid_bytes: int) -> dict:
    """Write corpus_clean.txt (shuffled copies of the documents up to `mb` MB) and corpus.txt
    (the same with `invalid_bytes` 0xFF bytes inserted)."""
    by_lang = source_documents(data_dir)
    docs = [d for items in by_lang.values() for d in items]
    unique = sum(len(d) + 2 for d in docs)
    target = int(mb * 1e6)
    clean, messy = workdir / "corpus_clean.txt", workdir / "corpus.txt"
    written, copies = 0, 0
    with open(clean, "wb") as f:
        while written < target:
            order = list(range(len(docs)))
            random.Random(copies).shuffle(order)
            copies += 1
            for i in order:
                f.write(docs[i] + b"\n\n")
                written += len(docs[i]) + 2
                if written >= target:
                    break
    # each 0xFF goes before an ASCII byte: the preceding character is then complete, so each
    # insertion is exactly one invalid character (never a split multi-byte one)
    positions = []
    with open(clean, "rb") as f:
        for k in range(1, invalid_bytes + 1):
            f.seek(k * written // (invalid_bytes + 1))
            chunk = f.read(4096)
            positions.append(f.tell() - len(chunk) + next(i for i, b in enumerate(chunk) if b < 0x80))
    with open(clean, "rb") as src, open(messy, "wb") as dst:
        done = 0
        for pos in positions + [written]:
            while done < pos:
                block = src.read(min(pos - done, 16 << 20))
                dst.write(block)
                done += len(block)
            if pos < written:
                dst.write(b"\xff")
    return {
        "corpus": str(messy),
        "clean_corpus": str(clean),
        "mb": round(messy.stat().st_size / 1e6, 2),
        "copies": round(written / unique, 2),
        "unique_mb": round(unique / 1e6, 2),
        "documents": len(docs),
        "invalid_bytes": invalid_bytes,
        "composition_mb": {lang: round(sum(len(d) + 2 for d in items) / 1e6, 2) for lang, items in by_lang.items()},
    }
