"""A shared store (data.store_dir) on a local S3 server against the same store on local disk:
prepare throughput with 1 and 2 processes acting as nodes, training tokens/s, and the memory and
local disk of a run that trains from the object store.

    python benchmarks/shared_store.py [--sizes 414,2048] [--data-dir ../shared/data] [--workdir DIR]
                                      [--files 16] [--steps 200] [--vocab-size 8000] [--tokenizer-mb 8]
                                      [--block-size 128] [--batch-size 32] [--cache-limit 1GB] [--json]

For each corpus size in --sizes (MB; mixed_corpus.py's builder, as benchmarks/data_store.py uses):
1. The corpus is cut into --files files at document boundaries (a part takes whole files), and a
   tokenizer is trained once on its first --tokenizer-mb MB (not measured) and given to every
   prepare below (tokenizer.path: parts train none).
2. `lit-transformer prepare` into s3://bench/one-<size> by one process, and into
   s3://bench/two-<size> by two processes started together with --part 0/2 and --part 1/2 (two
   "nodes" on this machine; the second to finish merges), and into a directory on local disk:
   wall s (both parts: until the last one ends), MB/s, CPU s, peak RSS of the largest process and
   peak PSS of each process tree (process_tree.measure).
3. `lit-transformer pretrain` for --steps steps from the S3 store and from the directory store:
   train/tokens_per_s (median after the first 10% of the steps), peak RSS and PSS, and the largest
   size of the run's local chunk cache (<cache>/stores/, sampled every 0.2 s) under
   data.store_cache_limit=--cache-limit: with the object store it must not grow with the corpus.

The S3 server is moto's (`moto.server.ThreadedMotoServer`, the tests' server; the `dev` extra),
in this process, on 127.0.0.1 over http: a Python server, whose own speed is part of what the S3
rows measure; a real bucket behaves otherwise (docs/data.md, "A shared store"). Not part of the
test suite; on a shared machine take the figures in a quiet window.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from large_corpus import QUIET_ENV, REPO, lit_command  # noqa: E402
from mixed_corpus import build_corpus  # noqa: E402
from process_tree import measure  # noqa: E402

sys.path.insert(0, str(REPO))

BUCKET = "bench"


def start_server() -> tuple[object, dict]:
    """moto's S3 server on a free port of 127.0.0.1, one bucket, and the environment that reaches it."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    os.environ.update(env)
    import boto3

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    return server, env


def split_corpus(corpus: Path, folder: Path, files: int) -> list[Path]:
    """`corpus` cut into `files` files of about equal bytes, each ending at a document's end."""
    folder.mkdir(parents=True, exist_ok=True)
    size = corpus.stat().st_size
    paths, start = [], 0
    with open(corpus, "rb") as src:
        for i in range(files):
            src.seek(min(size, (i + 1) * size // files))
            src.readline()
            while True:  # on to the next blank line: documents are blank-line separated
                line = src.readline()
                if not line or not line.strip():
                    break
            end = src.tell() if i < files - 1 else size
            src.seek(start)
            path = folder / f"part{i:03d}.txt"
            path.write_bytes(src.read(end - start))
            paths.append(path)
            start = end
    return [p for p in paths if p.stat().st_size > 0]


def overrides(folder: Path, store: str, workdir: Path, args, tokenizer: str, name: str) -> list[str]:
    return [
        f"data.train_files=[{folder}]",
        "data.val_fraction=0.001",
        "data.max_train_bytes=null",
        "data.max_val_bytes=null",
        f"data.block_size={args.block_size}",
        f"data.batch_size={args.batch_size}",
        "data.store=litdata",
        f"data.store_dir={store}",
        f"data.cache_dir={workdir / ('cache_' + name)}",
        f"tokenizer.path={tokenizer}",
    ]


def train_tokenizer(corpus: dict, workdir: Path, args, env: dict) -> str:
    run_dir = workdir / "run_tokenizer"
    cmd = lit_command(
        "prepare",
        [
            f"data.train_files=[{corpus['corpus']}]",
            f"data.max_train_bytes={int(args.tokenizer_mb * 1e6)}",
            f"tokenizer.vocab_size={args.vocab_size}",
            f"tokenizer.max_train_bytes={int(args.tokenizer_mb * 1e6)}",
            f"data.cache_dir={workdir / 'cache_tokenizer'}",
            f"run.dir={run_dir}",
        ],
    )
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"training the tokenizer failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return str(run_dir / "tokenizer.json")


def run_prepare(name: str, store: str, parts: int, folder: Path, mb: float, workdir: Path, args, env, tok) -> dict:
    """`parts` processes preparing `store` together; the slowest's wall time is the figure."""
    common = overrides(folder, store, workdir, args, tok, name)
    results: list[dict] = [{}] * parts

    def one(i: int) -> None:
        extra = [f"run.dir={workdir / f'run_{name}_{i}'}"] + (["--part", f"{i}/{parts}"] if parts > 1 else [])
        results[i] = measure(lit_command("prepare", [*common, *extra]), workdir / f"prepare_{name}_{i}.log", env, mb)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    failed = [i for i, r in enumerate(results) if r["rc"] != 0]
    return {
        "name": f"prepare {name} ({parts} process{'es' if parts > 1 else ''})",
        "command": " ".join(lit_command("prepare", common)) + (f" --part I/{parts}" if parts > 1 else ""),
        "wall_s": round(wall, 2),
        "mb_per_s": round(mb / wall, 2),
        "cpu_s": round(sum(r["cpu_s"] for r in results), 2),
        "peak_rss_gb": max(r["peak_rss_gb"] for r in results),
        "tree_pss_gb": max(r["tree_pss_gb"] for r in results),
        "result": "ok" if not failed else f"fails: see {workdir}/prepare_{name}_{failed[0]}.log",
    }


class DiskSampler(threading.Thread):
    """The largest total size of the files under `folder`, sampled every 0.2 s until `done`."""

    def __init__(self, folder: Path):
        super().__init__(daemon=True)
        self.folder, self.done, self.peak = folder, threading.Event(), 0

    def run(self) -> None:
        while not self.done.wait(0.2):
            total = 0
            for root, _, names in os.walk(self.folder):
                for n in names:
                    try:
                        total += os.stat(os.path.join(root, n)).st_size
                    except FileNotFoundError:  # deleted by litdata since the listing
                        pass
            self.peak = max(self.peak, total)


def run_training(name: str, store: str, folder: Path, mb: float, workdir: Path, args, env, tok) -> dict:
    from lit_transformer.training.rundir import read_metrics

    run_dir = workdir / f"train_{name}"
    extra = [
        f"trainer.max_steps={args.steps}",
        "trainer.limit_val_batches=1",
        f"trainer.val_check_interval={args.steps}",
        "trainer.log_every_n_steps=10",
        "trainer.precision=32-true",
        "logger.wandb.mode=disabled",
        "generation.enabled=false",
        f"data.store_cache_limit={args.cache_limit}",  # a directory store is read in place: no chunk cache
        f"run.dir={run_dir}",
        "run.overwrite=true",
    ]
    cmd = lit_command("pretrain", [*overrides(folder, store, workdir, args, tok, f"train_{name}"), *extra])
    sampler = DiskSampler(workdir / f"cache_train_{name}")
    sampler.start()
    result = measure(cmd, workdir / f"train_{name}.log", env, mb)
    sampler.done.set()
    sampler.join()
    result.pop("output")
    result.pop("mb_per_s")
    speeds = [(r["step"], r["train/tokens_per_s"]) for r in read_metrics(run_dir) if r.get("train/tokens_per_s")]
    kept = [s for step, s in speeds if step >= args.steps // 10]
    result.update(
        name=f"pretrain {args.steps} steps from {name}",
        command=" ".join(cmd),
        tokens_per_s=round(statistics.median(kept), 1) if kept else None,
        local_disk_gb=round(sampler.peak / 1e9, 4),
        result="ok" if result["rc"] == 0 and kept else f"fails (exit {result['rc']}): see {workdir}/train_{name}.log",
    )
    return result


def _row(r: dict) -> str:
    extra = f"{r['mb_per_s']:>7.2f} MB/s" if "mb_per_s" in r else ""
    if r.get("tokens_per_s") is not None:
        extra = f"{r['tokens_per_s']:>9,.0f} tokens/s, disk {r['local_disk_gb']:.3f} GB"
    return (
        f"{r['name']:<40} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} {r['peak_rss_gb']:>7.2f} {r['tree_pss_gb']:>7.2f}  "
        f"{extra:<36} {r['result'][:80]}"
    )


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="414,2048", help="corpus sizes in MB, comma-separated")
    parser.add_argument("--data-dir", default=str(REPO / ".." / "shared" / "data"))
    parser.add_argument("--workdir", help="keep corpora, stores and logs here (default: a temporary directory)")
    parser.add_argument("--files", type=int, default=16, help="input files the corpus is cut into")
    parser.add_argument("--steps", type=int, default=200, help="training steps per store")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--tokenizer-mb", type=float, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--cache-limit", default="1GB", help="data.store_cache_limit of the run from S3")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the table goes to stderr)")
    args = parser.parse_args()
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    server, aws = start_server()
    env = dict(
        os.environ,
        **QUIET_ENV,
        **aws,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="shared_store_")
    root = Path(args.workdir or tmp.name).resolve()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    say(f"machine    {cores} cores, load average {os.getloadavg()[0]:.2f}; S3: moto at {aws['AWS_ENDPOINT_URL']}")
    results = []
    try:
        for mb in [float(s) for s in args.sizes.split(",")]:
            workdir = root / f"mb{mb:g}"
            workdir.mkdir(parents=True, exist_ok=True)
            corpus = build_corpus(Path(args.data_dir), workdir, mb, invalid_bytes=48)
            folder = workdir / "files"
            files = split_corpus(Path(corpus["corpus"]), folder, args.files)
            say(f"corpus     {corpus['mb']} MB in {len(files)} files under {folder}")
            tok = train_tokenizer(corpus, workdir, args, env)
            say(f"{'':<40} {'wall s':>8} {'CPU s':>8} {'RSS GB':>7} {'PSS GB':>7}")
            stores = {"S3": f"s3://{BUCKET}/one-{mb:g}", "local disk": str(workdir / "store_local")}
            runs, data = [], (folder, corpus["mb"], workdir, args, env, tok)
            for name, store, parts in (
                ("S3", stores["S3"], 1),
                ("S3_in_parts", f"s3://{BUCKET}/two-{mb:g}", 2),
                ("local_disk", stores["local disk"], 1),
            ):
                runs.append(run_prepare(name, store, parts, *data))
                say(_row(runs[-1]))
            for name, store in stores.items():
                runs.append(run_training(name.replace(" ", "_"), store, *data))
                say(_row(runs[-1]))
            results.append({"corpus_mb": corpus["mb"], "files": len(files), "runs": runs})
    finally:
        server.stop()
        if tmp is not None:
            tmp.cleanup()
    out = {
        "cores": cores,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "block_size": args.block_size,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "cache_limit": args.cache_limit,
        "sizes": results,
    }
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
