"""The sharded token store (data.store=litdata) against the token cache (data.store=cache):
prepare throughput and memory, training tokens/s, and the data's resume time at the start of an
epoch and deep into it.

    python benchmarks/data_store.py [--sizes 414,2048] [--data-dir ../shared/data] [--workdir DIR]
                                    [--steps 200] [--vocab-size 8000] [--tokenizer-mb 8]
                                    [--block-size 128] [--batch-size 32] [--deep 0.9] [--json]

For each corpus size in --sizes (MB; mixed_corpus.py's builder, large_corpus.py's corpus: its
mixed English, German and Python documents, repeated with each copy shuffled until the size, 48
invalid bytes; 2048 and up is the generated multi-GB corpus):
1. A tokenizer is trained once on the first --tokenizer-mb MB (not measured) and given to every
   run below (tokenizer.path), so that both paths do the same work but the store's shards.
2. `lit-transformer prepare recipes/tiny-clm.yaml` into a fresh data.cache_dir, once with
   data.store=cache and once with data.store=litdata (the cache, then the shards written from it
   by every core): wall s, MB/s (corpus MB / wall), CPU s, peak RSS of the largest process and
   peak PSS of the process tree (process_tree.measure), and the shards' own seconds.
3. `lit-transformer pretrain` for --steps steps on each prepared cache (no tokenizing: the
   entries are reused), float32, one validation batch at the end, no sample generation, W&B off: train/tokens_per_s,
   median of the logged values after the first 10% of the steps.
4. Resume: in a fresh interpreter per store and position, the data module opens the prepared
   data, is given the state (epoch 0, k batches used) a checkpoint holds, and yields its first
   batch; k = 0 and k = --deep of the epoch's batches. `resume_s` is load_state_dict to the first
   batch; `read` is the blocks the store read to get there (litdata: StreamingDataset reads; the
   cache reads exactly the batch's rows by construction).

Not part of the test suite; on a shared machine take the figures in a quiet window.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from large_corpus import QUIET_ENV, REPO, lit_command  # noqa: E402
from mixed_corpus import build_corpus  # noqa: E402
from process_tree import measure  # noqa: E402

sys.path.insert(0, str(REPO))

STORES = ("cache", "litdata")
STORE_LINE = re.compile(r"^store\s+litdata shards .*?([\d.]+) s -> ", re.M)


def common_overrides(corpus: dict, workdir: Path, store: str, args, tokenizer: str) -> list[str]:
    return [
        f"data.train_files=[{corpus['corpus']}]",
        "data.max_train_bytes=null",
        "data.max_val_bytes=null",
        f"data.block_size={args.block_size}",
        f"data.batch_size={args.batch_size}",
        f"data.store={store}",
        f"data.cache_dir={workdir / ('cache_' + store)}",
        f"tokenizer.path={tokenizer}",
    ]


def train_tokenizer(corpus: dict, workdir: Path, args, env: dict) -> str:
    run_dir = workdir / "run_tokenizer"
    overrides = [
        f"data.train_files=[{corpus['corpus']}]",
        f"data.max_train_bytes={int(args.tokenizer_mb * 1e6)}",
        f"tokenizer.vocab_size={args.vocab_size}",
        f"tokenizer.max_train_bytes={int(args.tokenizer_mb * 1e6)}",
        f"data.cache_dir={workdir / 'cache_tokenizer'}",
        f"run.dir={run_dir}",
    ]
    done = subprocess.run(lit_command("prepare", overrides), env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"training the tokenizer failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return str(run_dir / "tokenizer.json")


def run_prepare(store: str, corpus: dict, workdir: Path, args, env: dict, tokenizer: str) -> dict:
    overrides = [*common_overrides(corpus, workdir, store, args, tokenizer), f"run.dir={workdir / ('run_' + store)}"]
    result = measure(lit_command("prepare", overrides), workdir / f"prepare_{store}.log", env, corpus["mb"])
    shards = STORE_LINE.findall(result.pop("output"))
    result.update(
        name=f"prepare, store={store}",
        command="lit-transformer prepare recipes/tiny-clm.yaml " + " ".join(overrides),
        shards_s=float(shards[0]) if shards else None,
        result="ok" if result["rc"] == 0 else f"fails (exit {result['rc']}): see {workdir / f'prepare_{store}.log'}",
    )
    return result


def run_training(store: str, corpus: dict, workdir: Path, args, env: dict, tokenizer: str) -> dict:
    from lit_transformer.training.rundir import read_metrics

    run_dir = workdir / f"train_{store}"
    overrides = [
        *common_overrides(corpus, workdir, store, args, tokenizer),
        f"trainer.max_steps={args.steps}",
        "trainer.limit_val_batches=1",  # one validation batch, at the end: the steps are what is timed
        f"trainer.val_check_interval={args.steps}",
        "trainer.log_every_n_steps=10",
        "trainer.precision=32-true",
        "logger.wandb.mode=disabled",
        "generation.enabled=false",
        f"run.dir={run_dir}",
        "run.overwrite=true",
    ]
    result = measure(lit_command("pretrain", overrides), workdir / f"train_{store}.log", env, corpus["mb"])
    result.pop("output")
    result.pop("mb_per_s")
    speeds = [
        (r["step"], r["train/tokens_per_s"]) for r in read_metrics(run_dir) if r.get("train/tokens_per_s") is not None
    ]
    kept = [s for step, s in speeds if step >= args.steps // 10]
    result.update(
        name=f"pretrain {args.steps} steps, store={store}",
        command="lit-transformer pretrain recipes/tiny-clm.yaml " + " ".join(overrides),
        tokens_per_s=round(statistics.median(kept), 1) if kept else None,
        result="ok" if result["rc"] == 0 and kept else f"fails (exit {result['rc']}): see {workdir}/train_{store}.log",
    )
    return result


def run_resume(store: str, fraction: float, corpus: dict, workdir: Path, args, env: dict, tokenizer: str) -> dict:
    overrides = common_overrides(corpus, workdir, store, args, tokenizer)
    cmd = [sys.executable, __file__, "_resume", str(fraction), *overrides]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"store": store, "fraction": fraction, "result": f"fails: {done.stderr.strip()[-500:]}"}
    return dict(json.loads(lines[-1]), store=store, fraction=fraction, result="ok")


def resume_child(fraction: float, overrides: list[str]) -> None:
    """Open the prepared data, restore (epoch 0, k batches) and time the first batch; one JSON line."""
    import litdata

    from lit_transformer.data.modules.text_module import TextDataModule
    from lit_transformer.recipe.load import load_recipe

    cfg = load_recipe(REPO / "recipes" / "tiny-clm.yaml", overrides)
    reads = [0]
    getitem = litdata.StreamingDataset.__getitem__

    def counted(self, index):
        reads[0] += 1
        return getitem(self, index)

    litdata.StreamingDataset.__getitem__ = counted
    dm = TextDataModule(cfg.data, cfg.tokenizer, "clm", seed=0)
    dm.setup("fit")
    batches = len(dm.train_dataloader())
    k = min(int(batches * fraction), batches - 1)
    t0 = time.perf_counter()
    dm.load_state_dict({"epoch": 0, "batches": k, "seed": 0})
    loader = dm.train_dataloader()
    next(iter(loader))
    seconds = time.perf_counter() - t0
    read = reads[0] if cfg.data.store == "litdata" else cfg.data.batch_size
    print(json.dumps({"batches": batches, "skipped": k, "resume_s": round(seconds, 4), "read": read}))


def _row(r: dict) -> str:
    extra = ""
    if "mb_per_s" in r:
        extra = f"{r['mb_per_s']:>7.2f} MB/s" + (f", shards {r['shards_s']} s" if r.get("shards_s") else "")
    if r.get("tokens_per_s") is not None:
        extra = f"{r['tokens_per_s']:>10,.0f} tokens/s"
    return (
        f"{r['name']:<34} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} {r['peak_rss_gb']:>7.2f} {r['tree_pss_gb']:>7.2f}  "
        f"{extra:<32} {r['result'][:80]}"
    )


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="414,2048", help="corpus sizes in MB, comma-separated")
    parser.add_argument("--data-dir", default=str(REPO / ".." / "shared" / "data"))
    parser.add_argument("--workdir", help="keep corpora, caches and logs here (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per store")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--tokenizer-mb", type=float, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--deep", type=float, default=0.9, help="the deep resume position, a fraction of the epoch")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the table goes to stderr)")
    args = parser.parse_args()
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    env = dict(
        os.environ, **QUIET_ENV, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="data_store_")
    root = Path(args.workdir or tmp.name).resolve()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    say(f"machine    {cores} cores, load average {os.getloadavg()[0]:.2f}")
    results = []
    try:
        for mb in [float(s) for s in args.sizes.split(",")]:
            workdir = root / f"mb{mb:g}"
            workdir.mkdir(parents=True, exist_ok=True)
            corpus = build_corpus(Path(args.data_dir), workdir, mb, invalid_bytes=48)
            say(f"corpus     {corpus['corpus']}: {corpus['mb']} MB, {corpus['copies']} shuffled copies")
            tokenizer = train_tokenizer(corpus, workdir, args, env)
            say(f"{'':<34} {'wall s':>8} {'CPU s':>8} {'RSS GB':>7} {'PSS GB':>7}")
            runs = []
            for store in STORES:
                runs.append(run_prepare(store, corpus, workdir, args, env, tokenizer))
                say(_row(runs[-1]))
            for store in STORES:
                runs.append(run_training(store, corpus, workdir, args, env, tokenizer))
                say(_row(runs[-1]))
            resumes = []
            for store in STORES:
                for fraction in (0.0, args.deep):
                    resumes.append(run_resume(store, fraction, corpus, workdir, args, env, tokenizer))
                    r = resumes[-1]
                    say(
                        f"resume     store={store:<8} at {fraction:>4.0%} of the epoch "
                        + (
                            f"(batch {r['skipped']:,} of {r['batches']:,}): {r['resume_s']:.3f} s, "
                            f"{r['read']} blocks read"
                            if r["result"] == "ok"
                            else r["result"]
                        )
                    )
            results.append({"corpus": corpus, "runs": runs, "resumes": resumes})
            for store in STORES:  # the next size needs the disk
                for name in (f"cache_{store}", f"train_{store}", f"run_{store}"):
                    subprocess.run(["rm", "-rf", str(workdir / name)], check=False)
    finally:
        if tmp is not None:
            tmp.cleanup()
    out = {
        "cores": cores,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "block_size": args.block_size,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "sizes": results,
    }
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_resume":
        resume_child(float(sys.argv[2]), sys.argv[3:])
    else:
        main()
