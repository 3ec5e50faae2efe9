"""Reading local files and hub datasets: the rules for bad input live here.

Rules (each counted in `ReadStats` and reported by `prepare`):

- A path that does not exist, a glob that matches nothing, a directory with no data files,
  an empty file, or a file with a NUL byte in its first KB (binary, or UTF-16) is a
  `DataError` naming the path.
- Text is decoded as UTF-8 (a leading BOM is dropped); invalid bytes become U+FFFD and are
  counted in `replaced_chars`.
- A line longer than `data.max_line_bytes` (default 1 MiB) is skipped whole and counted in
  `long_lines_skipped`: such a line is a minified blob or a data dump, not prose or code.
- `.txt` documents (`data.text_format`): `lines`: every non-blank line (a trailing '\\r' is
  dropped); `paragraphs`: runs of non-blank lines separated by blank lines, joined with '\\n';
  `file`: the whole file, byte for byte (apart from skipped lines).
- jsonl/json/csv/tsv/parquet go through `datasets`; a missing column names the column and
  lists those present. A stream (`data.streaming`) reads jsonl and parquet itself
  (`iter_jsonl`, `iter_parquet`, same rows), so that it can resume by seeking.
- A hub dataset (`data.hub_name`) needs network: with HF_DATASETS_OFFLINE / HF_HUB_OFFLINE set,
  or when the hub does not answer a TCP connect within 3 s, it fails at once, before
  `datasets` could wait on retries.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import socket
import sys
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lit_transformer.errors import DataError

EXTENSIONS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".py": "text",
    ".raw": "text",
    ".tokens": "text",
    ".jsonl": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
}
BUILDERS = {"jsonl": "json", "json": "json", "csv": "csv", "tsv": "csv", "parquet": "parquet"}
BINARY_PROBE_BYTES = 1024
READ_CHUNK = 1 << 20
CHECK_ROWS = 1000  # a stream checks the columns on its first rows, as `datasets` on its first batch


@dataclass
class ReadStats:
    documents: int = 0
    bytes: int = 0  # UTF-8 bytes of the documents kept (before tokenization)
    replaced_chars: int = 0
    long_lines_skipped: int = 0
    skipped_examples: int = 0  # blank pairs, missing values
    files: list[str] = field(default_factory=list)
    offset: int = 0  # in the file being read: the byte just past the last line read (a seek target)
    cursor: dict = field(default_factory=dict)  # where a source's next item starts (`SplitSource.position`)

    def note(self) -> str:
        parts = []
        if self.replaced_chars:
            parts.append(f"{self.replaced_chars} invalid UTF-8 bytes replaced")
        if self.long_lines_skipped:
            parts.append(f"{self.long_lines_skipped} lines over the length limit skipped")
        if self.skipped_examples:
            parts.append(f"{self.skipped_examples} blank examples skipped")
        return "; ".join(parts)


def resolve_files(specs: list[str], key: str, fmt: str = "auto") -> list[Path]:
    """Expand files, globs and directories (recursively, data extensions only) into sorted paths."""
    out: list[Path] = []
    for spec in specs:
        spec = os.path.expanduser(str(spec))
        if glob.has_magic(spec):
            matches = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
            if not matches:
                raise DataError(f"{key}: the glob {spec!r} matches no file")
            out.extend(matches)
        elif os.path.isdir(spec):
            matches = sorted(p for p in Path(spec).rglob("*") if p.is_file() and p.suffix.lower() in EXTENSIONS)
            if not matches:
                raise DataError(f"{key}: the directory {spec!r} holds no data file ({', '.join(EXTENSIONS)})")
            out.extend(matches)
        elif os.path.isfile(spec):
            out.append(Path(spec))
        else:
            raise DataError(f"{key}: no such file or directory: {spec!r}")
    for path in out:
        check_file(path, key, fmt)
    return out


def check_file(path: Path, key: str, fmt: str = "auto") -> None:
    if path.stat().st_size == 0:
        raise DataError(f"{key}: {path} is an empty file")
    if file_format(path, fmt, key) != "parquet":
        with open(path, "rb") as f:
            head = f.read(BINARY_PROBE_BYTES)
        if b"\x00" in head:
            raise DataError(f"{key}: {path} looks binary (NUL byte in the first KB); expected UTF-8 text")


def file_format(path: Path, fmt: str, key: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    if suffix not in EXTENSIONS:
        return "text"  # README, LICENSE, train.en, train.de ...
    return EXTENSIONS[suffix]


def split_format(paths: list[Path], fmt: str, key: str) -> str:
    formats = sorted({file_format(p, fmt, key) for p in paths})
    if len(formats) > 1:
        raise DataError(f"{key} mixes formats {formats}; give one format per split")
    return formats[0]


def files_fingerprint(paths: list[Path]) -> list:
    """Path, size and mtime of each file: a change to any file changes the cache key."""
    out = []
    for p in paths:
        st = p.stat()
        out.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return out


def decode(raw: bytes, stats: ReadStats) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", "replace")
        # U+FFFD already present in the file is encoded as EF BF BD: not a replacement
        stats.replaced_chars += text.count("\ufffd") - raw.count(b"\xef\xbf\xbd")
        return text


def iter_lines(path: Path, max_line_bytes: int, stats: ReadStats, start: int = 0) -> Iterator[str | None]:
    """Each line of a file without its '\\n' (the last one may be ''), None for a skipped long line.

    Reads in 1 MiB chunks, so memory stays bounded by `max_line_bytes` whatever the file size.
    Starts at byte `start` (a line start: a `stats.offset` seen before); before each line it
    yields, `stats.offset` is set to the byte after it, so a reader can resume there by seeking.
    """
    buf = bytearray()
    skipping = False
    first = start == 0
    base = start  # file offset of chunk[0]
    with open(path, "rb") as f:
        f.seek(start)
        while chunk := f.read(READ_CHUNK):
            if first:
                first = False
                if chunk.startswith(b"\xef\xbb\xbf"):
                    chunk = chunk[3:]
                    base += 3
            pos = 0
            while True:
                nl = chunk.find(b"\n", pos)
                if nl < 0:
                    if not skipping:
                        buf += chunk[pos:]
                        if len(buf) > max_line_bytes:
                            skipping = True
                            buf.clear()
                    break
                stats.offset = base + nl + 1
                if skipping:
                    skipping = False
                    stats.long_lines_skipped += 1
                    yield None
                else:
                    buf += chunk[pos:nl]
                    if len(buf) > max_line_bytes:
                        stats.long_lines_skipped += 1
                        yield None
                    else:
                        yield decode(bytes(buf), stats)
                buf.clear()
                pos = nl + 1
            base += len(chunk)
    stats.offset = base
    if skipping:
        stats.long_lines_skipped += 1
        yield None
    else:
        yield decode(bytes(buf), stats)


def iter_text_documents(
    path: Path, text_format: str, max_line_bytes: int, stats: ReadStats, start: int = 0
) -> Iterator[str]:
    """Documents of one text file under the `data.text_format` rule (module docstring), from byte
    `start` on; before each document it yields, `stats.offset` is where the next one starts."""
    lines = iter_lines(path, max_line_bytes, stats, start)
    if text_format == "file":
        text = "\n".join(line for line in lines if line is not None)
        if text.strip():
            yield text
        return
    if text_format == "lines":
        for line in lines:
            if line is not None and line.strip():
                yield line[:-1] if line.endswith("\r") else line
        return
    para: list[str] = []
    for line in lines:
        if line is None:
            continue
        if line.strip():
            para.append(line[:-1] if line.endswith("\r") else line)
        elif para:
            yield "\n".join(para)
            para = []
    if para:
        yield "\n".join(para)


def aligned_lines(src: Path, tgt: Path, max_line_bytes: int, stats: ReadStats) -> Iterator[tuple[str, str]]:
    """(source line, target line) pairs of two aligned files; unequal line counts are an error."""
    n_src, n_tgt = count_lines(src), count_lines(tgt)
    if n_src != n_tgt:
        raise DataError(
            f"misaligned seq2seq files: {src} has {n_src} lines but {tgt} has {n_tgt}; line i of one "
            "must translate line i of the other"
        )
    for i, (a, b) in enumerate(zip(iter_lines(src, max_line_bytes, stats), iter_lines(tgt, max_line_bytes, stats))):
        if i >= n_src:
            break  # the '' after a final newline
        a = a.rstrip("\r") if a is not None else None
        b = b.rstrip("\r") if b is not None else None
        if not a or not b or not a.strip() or not b.strip():
            stats.skipped_examples += 1
            continue
        yield a, b


def count_lines(path: Path) -> int:
    """Lines as a reader sees them: newlines, plus one for a last line without a newline."""
    n = 0
    last = b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def iter_jsonl(path: Path, stats: ReadStats, start: int = 0, *, columns: dict | None = None, where: str = ""):
    """The objects of a JSON-lines file from byte `start` (`stats.offset` as in `iter_lines`).
    `columns` (config key -> column) are checked against the keys of the first `CHECK_ROWS`."""
    head: list | None = [] if columns else None
    for line in iter_lines(path, sys.maxsize, stats, start):  # a row is never cut, however long
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise DataError(f"{path}: the line ending at byte {stats.offset} is not JSON ({exc})") from exc
        if not isinstance(row, dict):
            raise DataError(f"{path}: the line ending at byte {stats.offset} is not a JSON object")
        if head is None:
            yield row
            continue
        head.append((row, stats.offset))
        if len(head) == CHECK_ROWS:
            yield from _checked(head, columns, where, stats)
            head = None
    if head:
        yield from _checked(head, columns, where, stats)


def _checked(head: list, columns: dict, where: str, stats: ReadStats):
    require_columns(set().union(*(row for row, _ in head)), columns, where)
    end = stats.offset
    for row, stats.offset in head:
        yield row
    stats.offset = end


def iter_parquet(path: Path, columns: dict, where: str, start: tuple[int, int] = (0, 0)):
    """(row group, row in it, the `columns`' values) of a parquet file, from row `start[1]` of
    row group `start[0]`: a resumed read reads again the head of one row group, not the file."""
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's errors: name the file
        raise DataError(f"{path}: cannot read it as parquet: {str(exc).strip().splitlines()[0]}") from exc
    require_columns(f.schema_arrow.names, columns, where)
    names = list(dict.fromkeys(c for c in columns.values() if c is not None))
    for group in range(start[0], f.num_row_groups):
        row = 0
        for batch in f.iter_batches(batch_size=CHECK_ROWS, row_groups=[group], columns=names):
            values = {name: batch.column(name).to_pylist() for name in names}
            for j in range(batch.num_rows):
                if group > start[0] or row >= start[1]:
                    yield group, row, tuple(values[c][j] if c is not None else None for c in columns.values())
                row += 1


def load_table(
    paths: list[Path],
    fmt: str,
    key: str,
    *,
    streaming: bool = False,
    num_proc: int | None = None,
    cache_dir: str | None = None,
):
    """A `datasets` Dataset (or IterableDataset) of jsonl/json/csv/tsv/parquet files."""
    import datasets

    kwargs = {"delimiter": "\t"} if fmt == "tsv" else {}
    if not streaming:
        kwargs.update(num_proc=num_proc, cache_dir=cache_dir)
    try:
        with quiet_datasets():
            return datasets.load_dataset(
                BUILDERS[fmt], data_files=[str(p) for p in paths], split="train", streaming=streaming, **kwargs
            )
    except DataError:
        raise
    except Exception as exc:  # pyarrow / pandas parse errors: name the files
        names = ", ".join(str(p) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{key}: cannot read {names} as {fmt}: {first}") from exc


@contextlib.contextmanager
def quiet_datasets():
    """datasets' own progress bars and log lines ("Generating train split: ...") off: `prepare`
    reports each split itself, and a bad column must reach the user as the only line on stderr."""
    import datasets

    was_enabled = datasets.utils.logging.is_progress_bar_enabled()
    verbosity = datasets.utils.logging.get_verbosity()
    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(verbosity)
        if was_enabled:
            datasets.utils.logging.enable_progress_bar()


def require_columns(column_names, wanted: dict[str, str | None], where: str) -> None:
    """`wanted` maps config keys (data.text_column ...) to column names; None means unused."""
    for config_key, column in wanted.items():
        if column is not None and column not in column_names:
            raise DataError(f"{where}: no column {column!r} ({config_key}); available columns: {sorted(column_names)}")


def hub_available(name: str) -> None:
    """Fail at once, with the reason, when the hub cannot be reached."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            raise DataError(
                f"data.hub_name={name!r} needs the network but {var}={os.environ[var]} is set; "
                "use local data.train_files or unset it"
            )
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urllib.parse.urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=3).close()
    except OSError as exc:
        raise DataError(
            f"data.hub_name={name!r} needs the network but {url.hostname}:{port} is unreachable ({exc}); "
            "use local data.train_files"
        ) from exc


def load_hub(name: str, config: str | None, split: str, *, streaming: bool, cache_dir: str | None):
    import datasets

    hub_available(name)
    try:
        with quiet_datasets():
            return datasets.load_dataset(name, config, split=split, streaming=streaming, cache_dir=cache_dir)
    except Exception as exc:
        raise DataError(f"data.hub_name={name!r} (config {config!r}, split {split!r}): {exc}") from exc
