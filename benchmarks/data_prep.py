"""Tokenize-and-pack throughput on WikiText-2 with a byte-level BPE tokenizer trained on it.

    python benchmarks/data_prep.py [WIKITEXT2_DIR] [--vocab-size 8000] [--block-size 512] [--json]
                                   [--num-proc N] [--repeat-corpus K] [--switch-mb MB]

Reads WIKITEXT2_DIR/{valid,test}.txt (default ../shared/data/wikitext2 from the repo root),
trains the tokenizer (timed separately), then measures into a fresh temporary cache:
- first run: read + tokenize + pack + write the cache, in MB of UTF-8 text per second (and per core);
- reload: a second `build` that finds the cache (fingerprint, open the memmaps) and reads every token;
- peak resident memory of the process (ru_maxrss).
`first_run_mb_per_cpu_s` divides by the CPU time the process used (all threads), a per-core
rate that stays honest when other jobs share the machine; `first_run_mb_per_s_per_core`
divides wall-clock throughput by the core count. Targets: >= 5 MB/s per core; reload >= 20x
faster than the first run. `fast_path` says whether packing took fast_encode.py's word-cache
shortcut (the trained byte-level BPE does). For a pure single-core figure run with
RAYON_NUM_THREADS=1 (the Rust side then uses one thread). Not part of the test suite.

`--num-proc` is data.num_proc for packing (default 1; 0 means None, the automatic rule, which
packs the first `pack.SWITCH_CHARS` (16 MB, or `--switch-mb`) serially). `--repeat-corpus K`
packs K copies of the corpus (a temporary file) so that the automatic rule's pool engages. CPU
seconds count the pool's processes too (RUSAGE_CHILDREN: they are reaped before `build` returns).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lit_transformer.data.data_config import DataConfig, TokenizerConfig  # noqa: E402
from lit_transformer.data.tokens import pack  # noqa: E402
from lit_transformer.data.tokens.fast_encode import WordEncoder  # noqa: E402
from lit_transformer.data.tokens.pack import fast_copy  # noqa: E402
from lit_transformer.data.tokens.prepare import build  # noqa: E402


def _cpu_seconds() -> np.ndarray:
    """(this process, its reaped children) user + system CPU seconds."""
    r, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return np.array([r.ru_utime + r.ru_stime, c.ru_utime + c.ru_stime])


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=str(REPO / ".." / "shared" / "data" / "wikitext2"))
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--objective", default="clm", choices=["clm", "mlm", "span"])
    parser.add_argument("--repeat", type=int, default=3, help="first runs into fresh caches; the best is reported")
    parser.add_argument("--num-proc", type=int, default=1, help="data.num_proc for packing; 0: None (automatic)")
    parser.add_argument("--repeat-corpus", type=int, default=1, help="pack this many copies of the corpus")
    parser.add_argument(
        "--switch-mb",
        type=float,
        default=None,
        help="the automatic rule's serial prefix in MB (default: pack.SWITCH_CHARS)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    num_proc = args.num_proc or None
    if args.switch_mb is not None:
        pack.SWITCH_CHARS = int(args.switch_mb * 1e6)

    files = [str(Path(args.path) / name) for name in ("valid.txt", "test.txt")]
    workdir = tempfile.TemporaryDirectory()
    if args.repeat_corpus > 1:
        text = "".join(Path(f).read_text("utf-8") for f in files)
        files = [str(Path(workdir.name) / f"wikitext2_x{args.repeat_corpus}.txt")]
        Path(files[0]).write_text(text * args.repeat_corpus, "utf-8")
    rss_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # torch + lightning + tokenizers
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with tempfile.TemporaryDirectory() as cache:
        data = DataConfig(
            train_files=files,
            text_format="lines",
            val_fraction=0.0,
            block_size=args.block_size,
            cache_dir=cache,
            num_proc=num_proc,
        )
        tok = TokenizerConfig(kind="bpe", vocab_size=args.vocab_size, num_sentinels=100)

        # 1. tokenizer training (cached afterwards under the same cache root)
        t0 = time.perf_counter()
        from lit_transformer.data.sources.corpus import build_sources
        from lit_transformer.data.tokens.prepare import resolve_tokenizer

        resolve_tokenizer(data, tok, build_sources(data, args.objective), build=True)
        train_s = time.perf_counter() - t0

        # 2. first run: tokenize + pack + write (the tokenizer now comes from the cache). The
        #    machine is shared, so the best of --repeat runs into fresh caches is reported.
        #    CPU seconds (user + system, all threads) give a per-core rate that other load
        #    on the machine does not distort.
        runs, cpu = [], []
        for _ in range(args.repeat):
            for entry in Path(cache).iterdir():
                if entry.name != "tokenizers":
                    shutil.rmtree(entry)
            c0, t0 = _cpu_seconds(), time.perf_counter()
            first = build(data, tok, args.objective, build=True)
            runs.append(time.perf_counter() - t0)
            cpu.append(_cpu_seconds() - c0)
        best = int(np.argmin([c.sum() for c in cpu]))
        first_s = min(runs)
        meta = first.entries["train"].meta
        fast_path = WordEncoder.create(fast_copy(first.tokenizer), first.special.separator_id) is not None

        # 3. reload: a cache hit, then read every token once
        reloads = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            again = build(data, tok, args.objective, build=False)
            checksum = int(np.asarray(again.entries["train"]["tokens"], dtype=np.int64).sum())
            reloads.append(time.perf_counter() - t0)
        reload_s = min(reloads)
        assert checksum == int(np.asarray(first.entries["train"]["tokens"], dtype=np.int64).sum())
    workdir.cleanup()

    mb = meta["bytes"] / 1e6
    result = {
        "corpus": files,
        "repeat_corpus": args.repeat_corpus,
        "mb": round(mb, 3),
        "documents": meta["documents"],
        "tokens": meta["tokens"],
        "blocks": meta["blocks"],
        "block_size": args.block_size,
        "vocab_size": args.vocab_size,
        "cores": cores,
        "tokenizer_train_s": round(train_s, 3),
        "fast_path": fast_path,
        "num_proc": num_proc
        if num_proc is not None
        else f"auto ({pack.auto_num_proc()} after {pack.SWITCH_CHARS / 1e6:g} MB)",
        "rayon_num_threads": os.environ.get("RAYON_NUM_THREADS", "all cores"),
        "first_run_s": round(first_s, 3),
        "first_run_all_s": [round(r, 3) for r in runs],
        "first_run_mb_per_s": round(mb / first_s, 2),
        "first_run_mb_per_s_per_core": round(mb / first_s / cores, 2),
        "first_run_cpu_s": round(cpu[best].sum(), 3),
        "first_run_mb_per_cpu_s": round(mb / cpu[best].sum(), 2),
        "first_run_workers_cpu_s": round(cpu[best][1], 3),  # the pool's share (0 with one process)
        "reload_s": round(reload_s, 4),
        "reload_mb_per_s": round(mb / reload_s, 1),
        "reload_speedup": round(first_s / reload_s, 1),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_after_imports_mb": round(rss_imports, 1),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:<30} {value}")
    return result


if __name__ == "__main__":
    main()
