"""Large-corpus check: `prepare` on a few hundred MB of mixed text against transformers' run_clm
pipeline on the same file, and a streaming run's peak memory as the step count grows.

    python benchmarks/large_corpus.py [--mb 400] [--data-dir ../shared/data] [--workdir DIR]
                                      [--steps 100,1000] [--vocab-size 8000] [--tokenizer-mb 8]
                                      [--block-size 128] [--invalid-bytes 48]
                                      [--skip-baseline] [--skip-streaming] [--json]

1. Corpus (in --workdir, default a temporary directory removed afterwards): English
   (DATA_DIR/wikitext2/*.txt paragraphs, DATA_DIR/*/*.en in runs of 20 lines), German
   (DATA_DIR/*_de_en/*.de, 20 lines a document) and Python (the standard library's *.py files
   outside test and site-packages directories, one document per file) as blank-line separated
   documents, repeated with each copy's document order shuffled (seed = copy number) until --mb
   MB; then --invalid-bytes 0xFF bytes at evenly spaced positions, each before an ASCII byte so
   that each is exactly one invalid character (corpus.txt, the messy real-world corpus), beside
   corpus_clean.txt, the same text without them.
2. `lit-transformer prepare recipes/tiny-clm.yaml` with data.train_files=[corpus.txt], a fresh
   data.cache_dir, no data.max_train_bytes cap, data.block_size=--block-size and an 8k byte-level
   BPE trained on the first --tokenizer-mb MB (tokenizer.max_train_bytes). Two runs into fresh
   caches: `prepare` trains the tokenizer (what a user runs: start-up + tokenizer training +
   tokenize/pack/write of the train and validation splits); `prepare, given tokenizer` loads the
   first run's tokenizer.json (tokenizer.path), the same work as the baseline. `pack_s` is the
   splits' own seconds as prepare prints them; `wall_s - pack_s` is start-up (imports) plus,
   in the first run, tokenizer training. `replaced` is the invalid UTF-8 characters prepare
   reports replaced by U+FFFD (expected: --invalid-bytes).
3. Baseline (skipped when transformers or datasets is missing): transformers'
   examples/pytorch/language-modeling/run_clm.py preprocessing, reproduced step for step in a
   fresh interpreter: load_dataset("text", keep_linebreaks=True) with the 5% validation slice,
   `map(tokenize_function, batched=True, num_proc=2, remove_columns=["text"])` with a
   PreTrainedTokenizerFast wrapping the tokenizer.json lit-transformer trained (same BPE, nothing
   downloaded), then `map(group_texts, batched=True, num_proc=2)` in blocks of --block-size, with
   a fresh HF_DATASETS_CACHE. First on corpus.txt (run_clm stops there with a
   UnicodeDecodeError: reported as `fails`), then on corpus_clean.txt.
4. Streaming: `lit-transformer pretrain recipes/tiny-clm.yaml data.streaming=true` on corpus.txt
   with the prepared tokenizer (tokenizer.path: nothing retrained), W&B disabled, sample
   generation off, for each of --steps; peak memory per step count and the ratio of the last to
   the first (flat: within a few %).

Every measured command runs as a child process, from launch to exit (imports included), with:
- `wall_s`, `mb_per_s` = corpus MB (10^6 bytes of the file) / wall_s, `cpu_s` (user + system of
  the child and the workers it reaped);
- `peak_rss_gb`: the kernel's peak resident set of the largest single process among the child
  and its reaped workers (os.wait4's ru_maxrss);
- `tree_rss_gb`, `tree_pss_gb`: the peak over time of the RSS, and of the PSS (shared pages
  divided among the processes sharing them, so forked workers are not counted twice), summed over
  the child and all its descendants, sampled every 0.2 s from /proc/PID/smaps_rollup. tree PSS is
  the memory the whole job holds; RSS includes page-cache pages of memory-mapped files (the
  token cache, datasets' Arrow files) while they are resident.
The corpus is read from the page cache in every run (it was just written). Not part of the test
suite; on a shared machine take the figures in a quiet window.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "tiny-clm.yaml"
RUN_CLM_VALIDATION_PERCENT = 5  # run_clm.py's --validation_split_percentage default
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled"}

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mixed_corpus import build_corpus  # noqa: E402
from process_tree import measure  # noqa: E402


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------
# lit-transformer


SPLIT_LINE = re.compile(
    r"^(train|validation)\s+([\d,]+) documents\s+([\d,]+) tokens\s+([\d,]+) blocks\s+"
    r"([\d.]+) s\s+([\d.]+) MB/s(.*)$",
    re.M,
)


def lit_command(command: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "lit_transformer.commands.cli", command, str(RECIPE), *overrides]


def run_prepare(name: str, corpus: dict, workdir: Path, args, env: dict, tokenizer: str | None) -> dict:
    tok = (
        [f"tokenizer.path={tokenizer}"]
        if tokenizer
        else [f"tokenizer.vocab_size={args.vocab_size}", f"tokenizer.max_train_bytes={int(args.tokenizer_mb * 1e6)}"]
    )
    overrides = [
        f"data.train_files=[{corpus['corpus']}]",
        "data.max_train_bytes=null",
        "data.max_val_bytes=null",
        f"data.block_size={args.block_size}",
        f"data.cache_dir={workdir / ('cache_' + name)}",
        f"run.dir={workdir / ('run_' + name)}",
        *tok,
    ]
    result = measure(lit_command("prepare", overrides), workdir / f"{name}.log", env, corpus["mb"])
    splits = {
        m[0]: {
            "documents": int(m[1].replace(",", "")),
            "tokens": int(m[2].replace(",", "")),
            "blocks": int(m[3].replace(",", "")),
            "seconds": float(m[4]),
            "notes": m[6].strip(),
        }
        for m in SPLIT_LINE.findall(result["output"])
    }
    # counted while reading the file: the validation split is drawn from the same file, so each
    # split's line reports the file's count; the train split's is the corpus total
    replaced = re.findall(r"replaced_chars=(\d+)", splits.get("train", {}).get("notes", ""))
    result.update(
        name=f"lit-transformer prepare{', given tokenizer' if tokenizer else ''}",
        command="lit-transformer prepare recipes/tiny-clm.yaml " + " ".join(overrides),
        tokens=sum(s["tokens"] for s in splits.values()),
        blocks=sum(s["blocks"] for s in splits.values()),
        pack_s=round(sum(s["seconds"] for s in splits.values()), 2),
        replaced=int(replaced[0]) if replaced else 0,
        tokenizer_json=str(workdir / f"run_{name}" / "tokenizer.json"),
        splits=splits,
        result="ok" if result["rc"] == 0 and splits else f"fails (exit {result['rc']}): {_tail(result['output'], 3)}",
    )
    return result


def run_streaming(steps: int, corpus: dict, workdir: Path, args, env: dict, tokenizer: str) -> dict:
    overrides = [
        f"data.train_files=[{corpus['corpus']}]",
        "data.streaming=true",
        "data.max_train_bytes=null",
        f"data.block_size={args.block_size}",
        f"data.cache_dir={workdir / 'cache_streaming'}",
        f"tokenizer.path={tokenizer}",
        f"trainer.max_steps={steps}",
        "logger.wandb.mode=disabled",
        # the recipe's bf16-mixed was 15x slower per step (0.14 against 2.2 it/s) on a CPU without
        # bf16 matrix instructions; precision does not change what this measures (data memory)
        "trainer.precision=32-true",
        "generation.enabled=false",
        f"run.dir={workdir / f'run_streaming_{steps}'}",
        "run.overwrite=true",
    ]
    result = measure(lit_command("pretrain", overrides), workdir / f"streaming_{steps}.log", env, corpus["mb"])
    metrics = {}
    for line in result["output"].splitlines():
        if line.startswith('{"run_dir"'):
            metrics = json.loads(line)
    result.update(
        name=f"streaming pretrain, {steps} steps",
        steps=steps,
        command="lit-transformer pretrain recipes/tiny-clm.yaml " + " ".join(overrides),
        val_loss=metrics.get("val/loss"),
        result="ok" if result["rc"] == 0 else f"fails (exit {result['rc']}): {_tail(result['output'], 3)}",
    )
    result.pop("mb_per_s")
    return result


# ---------------------------------------------------------------------------------------------
# baseline: transformers' run_clm.py preprocessing, in a fresh interpreter


def baseline_child(train_file: str, tokenizer_json: str, block_size: int, num_proc: int) -> None:
    """run_clm.py's data path (load_dataset text -> validation slice -> tokenize map -> group_texts map).
    Prints one JSON line; a failure is reported as its exception chain, as run_clm would stop."""
    from itertools import chain

    t0 = time.perf_counter()
    out: dict = {}
    try:
        import transformers
        from datasets import load_dataset
        from transformers import PreTrainedTokenizerFast
        from transformers.testing_utils import CaptureLogger

        out["imports_s"] = round(time.perf_counter() - t0, 2)
        # the tokenizer GPT2TokenizerFast would be: input_ids and attention_mask
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=tokenizer_json, model_input_names=["input_ids", "attention_mask"]
        )
        data_files = {"train": train_file}
        dataset_args = {"keep_linebreaks": True}
        t = time.perf_counter()
        raw_datasets = load_dataset("text", data_files=data_files, **dataset_args)
        if "validation" not in raw_datasets:
            raw_datasets["validation"] = load_dataset(
                "text", data_files=data_files, split=f"train[:{RUN_CLM_VALIDATION_PERCENT}%]", **dataset_args
            )
            raw_datasets["train"] = load_dataset(
                "text", data_files=data_files, split=f"train[{RUN_CLM_VALIDATION_PERCENT}%:]", **dataset_args
            )
        out["load_s"] = round(time.perf_counter() - t, 2)
        column_names = list(raw_datasets["train"].features)
        text_column_name = "text" if "text" in column_names else column_names[0]
        tok_logger = transformers.utils.logging.get_logger("transformers.tokenization_utils_base")

        def tokenize_function(examples):
            with CaptureLogger(tok_logger):
                return tokenizer(examples[text_column_name])

        t = time.perf_counter()
        tokenized_datasets = raw_datasets.map(
            tokenize_function,
            batched=True,
            num_proc=num_proc,
            remove_columns=column_names,
            desc="Running tokenizer on dataset",
        )
        out["tokenize_s"] = round(time.perf_counter() - t, 2)

        def group_texts(examples):
            concatenated_examples = {k: list(chain(*examples[k])) for k in examples}
            total_length = len(concatenated_examples[list(examples.keys())[0]])
            total_length = (total_length // block_size) * block_size
            result = {
                k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
                for k, t in concatenated_examples.items()
            }
            result["labels"] = result["input_ids"].copy()
            return result

        t = time.perf_counter()
        lm_datasets = tokenized_datasets.map(
            group_texts, batched=True, num_proc=num_proc, desc=f"Grouping texts in chunks of {block_size}"
        )
        out["group_s"] = round(time.perf_counter() - t, 2)
        out["blocks"] = sum(len(d) for d in lm_datasets.values())
        out["tokens"] = sum(len(d) for d in lm_datasets.values()) * block_size
        out["result"] = "ok"
    except Exception as error:  # noqa: BLE001 - reported, as run_clm would stop on it
        chain_, e = [], error
        while e is not None:
            chain_.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            e = e.__cause__ or e.__context__
        out["result"] = "fails: " + " <- ".join(chain_)
    out["inner_s"] = round(time.perf_counter() - t0, 2)
    print("BASELINE " + json.dumps(out), flush=True)


def run_baseline(label: str, train_file: str, mb: float, workdir: Path, args, env: dict, tokenizer: str) -> dict:
    cache = workdir / f"hf_cache_{label}"
    env = dict(env, HF_DATASETS_CACHE=str(cache), HF_HOME=str(workdir / "hf_home"))
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "_baseline",
        train_file,
        tokenizer,
        str(args.block_size),
        str(args.num_proc),
    ]
    result = measure(cmd, workdir / f"baseline_{label}.log", env, mb)
    found = [line for line in result["output"].splitlines() if line.startswith("BASELINE ")]
    inner = (
        json.loads(found[-1][len("BASELINE ") :])
        if found
        else {"result": f"fails (exit {result['rc']}): {_tail(result['output'], 3)}"}
    )
    result.update(inner, name=f"run_clm pipeline, {label} corpus")
    if result["result"] != "ok":
        result.pop("mb_per_s")  # no throughput for a run that stopped
    shutil.rmtree(cache, ignore_errors=True)
    return result


# ---------------------------------------------------------------------------------------------


def _row(r: dict) -> str:
    mbps = f"{r['mb_per_s']:>7.2f}" if "mb_per_s" in r else f"{'':>7}"
    return (
        f"{r['name']:<42} {r['wall_s']:>8.1f} {mbps} {r['cpu_s']:>8.1f} {r['peak_rss_gb']:>7.2f} "
        f"{r['tree_rss_gb']:>7.2f} {r['tree_pss_gb']:>7.2f}  {r['result'][:110]}"
    )


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=400, help="corpus size in MB (default 400)")
    parser.add_argument("--data-dir", default=str(REPO / ".." / "shared" / "data"))
    parser.add_argument("--workdir", help="keep the corpus, caches and logs here (default: a temporary directory)")
    parser.add_argument("--steps", default="100,1000", help="streaming run lengths, comma-separated")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--tokenizer-mb", type=float, default=8, help="tokenizer.max_train_bytes in MB")
    parser.add_argument("--block-size", type=int, default=128, help="data.block_size and run_clm's --block_size")
    parser.add_argument("--num-proc", type=int, default=2, help="run_clm's --preprocessing_num_workers")
    parser.add_argument("--invalid-bytes", type=int, default=48)
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--skip-streaming", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the table goes to stderr)")
    args = parser.parse_args()
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))

    env = dict(
        os.environ, **QUIET_ENV, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="large_corpus_")
    workdir = Path(args.workdir or tmp.name).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        t0 = time.perf_counter()
        corpus = build_corpus(Path(args.data_dir), workdir, args.mb, args.invalid_bytes)
        say(
            f"corpus     {corpus['corpus']}: {corpus['mb']} MB, {corpus['copies']} shuffled copies of "
            f"{corpus['documents']:,} documents ({corpus['unique_mb']} MB: "
            + ", ".join(f"{k} {v} MB" for k, v in corpus["composition_mb"].items())
            + f"), {args.invalid_bytes} invalid bytes; built in {time.perf_counter() - t0:.1f} s"
        )
        say(f"machine    {cores} cores, load average {os.getloadavg()[0]:.2f}")
        header = f"{'':<42} {'wall s':>8} {'MB/s':>7} {'CPU s':>8} {'RSS GB':>7} {'tree':>7} {'PSS':>7}  result"
        say(header)
        runs = []

        prep = run_prepare("prepare", corpus, workdir, args, env, tokenizer=None)
        runs.append(prep)
        say(_row(prep))
        if prep["result"] != "ok":
            raise SystemExit(prep["result"])
        tokenizer = prep["tokenizer_json"]
        given = run_prepare("prepare_given_tokenizer", corpus, workdir, args, env, tokenizer=tokenizer)
        runs.append(given)
        say(_row(given))
        shutil.rmtree(workdir / "cache_prepare", ignore_errors=True)
        shutil.rmtree(workdir / "cache_prepare_given_tokenizer", ignore_errors=True)

        try:
            import datasets  # noqa: F401
            import transformers  # noqa: F401

            have_hf = True
        except ImportError as error:
            have_hf = False
            say(f"baseline   skipped: {error}")
        if have_hf and not args.skip_baseline:
            for label, path in (("messy", corpus["corpus"]), ("clean", corpus["clean_corpus"])):
                runs.append(run_baseline(label, path, corpus["mb"], workdir, args, env, tokenizer))
                say(_row(runs[-1]))

        ratios = {}
        if not args.skip_streaming:
            streaming = []
            for steps in args.steps.split(","):
                streaming.append(run_streaming(int(steps), corpus, workdir, args, env, tokenizer))
                say(_row(streaming[-1]))
            runs += streaming
            if all(r["result"] == "ok" for r in streaming) and len(streaming) > 1:
                for key in ("peak_rss_gb", "tree_pss_gb"):
                    ratios[key] = round(streaming[-1][key] / streaming[0][key], 3)
                say(
                    f"streaming  peak memory at {streaming[-1]['steps']} / {streaming[0]['steps']} steps: "
                    + ", ".join(f"{k} x{v}" for k, v in ratios.items())
                )

        # start-up (imports, recipe, reading the tokenizer) is wall - pack in the second run
        tokenizer_train_s = round((prep["wall_s"] - prep["pack_s"]) - (given["wall_s"] - given["pack_s"]), 1)
        say(
            f"prepare    {prep['replaced']} invalid UTF-8 characters replaced (injected: {args.invalid_bytes}); "
            f"tokenize+pack {prep['pack_s']} s of {prep['wall_s']} s; tokenizer training on {args.tokenizer_mb:g} MB "
            f"~{tokenizer_train_s} s (the difference of the two runs' wall - pack); given the tokenizer: "
            f"pack {given['pack_s']} s of {given['wall_s']} s"
        )
        for r in runs:
            if "tokenize_s" in r:
                say(
                    f"baseline   {r['name']}: imports {r['imports_s']} s, load_dataset {r['load_s']} s, tokenize map "
                    f"{r['tokenize_s']} s, group_texts map {r['group_s']} s; "
                    f"{r['blocks']:,} blocks of {args.block_size}"
                )
        for r in runs:
            r.pop("output", None)
        result = {
            "corpus": corpus,
            "cores": cores,
            "load_average_1min": round(os.getloadavg()[0], 2),
            "vocab_size": args.vocab_size,
            "tokenizer_mb": args.tokenizer_mb,
            "block_size": args.block_size,
            "tokenizer_train_s_estimate": tokenizer_train_s,
            "streaming_peak_ratio": ratios,
            "runs": runs,
        }
    finally:
        if tmp is not None:
            tmp.cleanup()
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_baseline":
        baseline_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
