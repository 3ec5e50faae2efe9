"""Training speed against transformers and the hardware, plus generation and data preparation.

For each family (BERT masked LM, GPT-2 causal LM, T5 span corruption) at a GPT-2-small-class
size (d_model 768, 12 heads, d_ff 3072, the families' own vocabularies), one training step
(forward + backward + AdamW) of ours, through the objective a run trains with, and of
transformers' BertForMaskedLM / GPT2LMHeadModel / T5ForConditionalGeneration built from the
equivalent config (our export mapping) with OUR weights copied in (so the first losses must
agree: a check that both compute the same model; when they differ by more than 2% the run stops
with exit status 1, naming the family and both losses), the same batch, precision, dropout (0) and
optimizer (torch's fused AdamW on both). Both run in one process, step by step alternately
with a matrix-product probe in the steps' dtype, so that background load falls on all three alike.

    python benchmarks/run.py --quick            # CPU: 4 layers, T=256, B=4, 5 rounds; about 2 minutes on 2 cores
    python benchmarks/run.py --quick --json     # one JSON object on stdout (the table on stderr)
    python benchmarks/run.py                    # CPU: 12 layers, T=512
    python benchmarks/run.py --device cuda --compile --json   # GPU figures (GPT-2 at T=1024)

Reported per family:
  tokens_per_s      sequence tokens per second of the fastest step (the least disturbed by
                    other processes; medians are in the JSON). T5: encoder input tokens, as the
                    T5 paper and `accounting.train_flops_per_token` count them.
  speedup_vs_transformers  the median over rounds of transformers' step time / ours, each
                    ratio from two adjacent steps (robust to load that changes during the run),
                    with `speedup_range`, the lowest and highest of those ratios: the headline
                    is "median (min-max)", never one side's best step against the other's.
  mfu               tokens_per_s x model FLOPs per token / matmul_peak_flops. FLOPs are
                    `accounting.train_flops` (PaLM's 6N + attention, full T x T scores), with the
                    LM head counted on the positions it actually runs on: all of them, except
                    in our masked LM, which projects only the masked 15% (transformers' BERT
                    projects all, and `transformers_mfu` counts all).
  matmul_peak_flops the highest FLOP/s of a torch.mm loop in the dtype the steps' matrix
                    products run in (bfloat16, or float32 for 32-true), 4096^3 on CPU (2048^3
                    with --quick) or 8192^3 on GPU, sampled before, between and after the steps.
  peak_memory_bytes GPU: torch.cuda.max_memory_allocated during a step above what was allocated
                    before it, plus the side's own parameters and AdamW state. CPU: the
                    resident-set high-water mark of a fresh process that builds that side alone
                    and runs two steps, less its resident set after the imports: weights,
                    gradients, AdamW moments and the activation peak, plus allocator slack.
Precision: the same on both sides, chosen from the machine unless --precision is given:
bf16-mixed (torch.autocast(bfloat16) around forward and loss, float32 weights and optimizer) on
CUDA or on a CPU with bf16 matrix instructions (AMX, AVX512-BF16), otherwise 32-true, because
there bf16 is emulated and would measure the emulation. The table and the JSON (`precision`,
`precision_reason`) say which and why. --precision bf16-true: bf16 weights.

Sections after the training steps: generation (benchmarks/generation.py: its --quick matrix
with --quick, on CPU otherwise its whole matrix but batch 32) and data preparation
(benchmarks/data_prep.py; one repeat with --quick); skip them with --no-generation /
--no-data-prep, and the CPU memory subprocesses with --no-memory (--quick skips those unless
--memory is given).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SIZES = {  # (layers per stack, sequence length, batch) for each mode
    "quick": {"bert_mlm": (4, 256, 4), "gpt2_clm": (4, 256, 4), "t5_span": (4, 256, 4)},
    "cpu": {"bert_mlm": (12, 512, 2), "gpt2_clm": (12, 512, 2), "t5_span": (12, 512, 2)},
    "cuda": {"bert_mlm": (12, 512, 32), "gpt2_clm": (12, 1024, 16), "t5_span": (12, 512, 32)},
}
PEAK_SIZES = {"quick": (2048, 2), "cpu": (4096, 2), "cuda": (8192, 10)}  # (size, products per call)
TARGETS = {"cpu_speedup": 1.5, "cpu_mfu": 0.25, "gpu_speedup": 1.3, "gpu_gpt2_mfu": 0.45}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--quick", action="store_true", help="CPU sizes that run in minutes: 4 layers, T=256, B=4, 5 timed steps"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (tables on stderr)")
    p.add_argument("--families", default=",".join(common.FAMILIES), help="comma-separated subset")
    p.add_argument(
        "--precision",
        choices=common.PRECISIONS,
        help="default: bf16-mixed on CUDA or a CPU with bf16 matrix instructions, else 32-true",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile: ours per block (the objective's option), transformers' whole model",
    )
    p.add_argument("--layers", type=int, help="override the layers per stack")
    p.add_argument("--seq-len", type=int, help="override the sequence (T5: encoder input) length")
    p.add_argument("--batch", type=int, help="override the batch size")
    p.add_argument("--rounds", type=int, help="timed steps per side (default 5 on CPU, 10 on GPU)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    p.add_argument(
        "--memory",
        action="store_true",
        help="with --quick: measure CPU peak memory too (two fresh processes per family, each importing "
        "torch, Lightning and transformers: minutes on 2 cores, so --quick skips it by default)",
    )
    p.add_argument("--no-generation", action="store_true")
    p.add_argument("--no-data-prep", action="store_true")
    args = p.parse_args(argv)
    args.cuda = args.device.startswith("cuda")
    if args.cuda and args.quick:
        p.error("--quick is the CPU smoke run; on a GPU run the full sizes")
    if args.compile and not args.cuda and args.quick:
        p.error("--compile on CPU compiles for minutes; not with --quick")
    args.mode = "cuda" if args.cuda else "quick" if args.quick else "cpu"
    if args.memory and args.no_memory:
        p.error("--memory and --no-memory contradict each other")
    args.no_memory = args.no_memory or (args.quick and not args.memory)
    args.rounds = args.rounds or {"quick": 5, "cpu": 5, "cuda": 10}[args.mode]
    args.precision, args.precision_reason = common.choose_precision(args.device, args.precision)
    args.warmup = 3 if args.cuda else 2 if args.compile else 1
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    for family in args.families:
        if family not in common.FAMILIES:
            p.error(f"unknown family {family!r}; choose from {', '.join(common.FAMILIES)}")
    return args


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def setup_args(args, family: str) -> dict:
    layers, seq_len, batch = SIZES[args.mode][family]
    return {"layers": args.layers or layers, "seq_len": args.seq_len or seq_len, "batch": args.batch or batch}


def make_peak(args) -> common.MatmulPeak:
    size, inner = PEAK_SIZES[args.mode]
    return common.MatmulPeak(args.device, size=size, inner=inner, dtype=common.matmul_dtype(args.precision))


def run_family(args, family: str, peak: common.MatmulPeak) -> dict:
    sargs = setup_args(args, family)
    setup = common.make_setup(family, **sargs)
    batch = common.make_batch(setup, args.device)
    ours = common.build_ours(setup, args.device, args.precision, compile=args.compile)
    hf = common.build_hf(setup, args.device, args.precision, compile=args.compile, ours=ours.module.model)
    # The first step of each: same weights, same batch, so the losses must agree; otherwise the
    # two sides are different models and no speed figure of this family is valid.
    loss, hf_loss = float(ours.step(batch)), float(hf.step(batch))
    common.check_first_losses(family, loss, hf_loss)
    times = common.time_alternating(
        {"ours": ours.step, "hf": hf.step, "peak": peak},
        batch,
        args.device,
        warmup=max(args.warmup - 1, 0),
        rounds=args.rounds,
    )
    best, hf_best = min(times["ours"]), min(times["hf"])
    speedup = common.paired_speedup(times["ours"], times["hf"])
    flops = common.spent_flops(setup, batch, head_everywhere=family != "bert_mlm")
    hf_flops = common.spent_flops(setup, batch, head_everywhere=True)
    tokens = setup.tokens
    result = {
        "family": family,
        "config": setup.description,
        "precision": args.precision + (" compile" if args.compile else ""),
        "tokens_per_s": tokens / best,
        "mfu": None,
        "peak_memory_bytes": None,
        "transformers_tokens_per_s": tokens / hf_best,
        "speedup_vs_transformers": speedup["median"],
        "speedup_range": [speedup["min"], speedup["max"]],
        "tokens_per_s_median": tokens / statistics.median(times["ours"]),
        "transformers_tokens_per_s_median": tokens / statistics.median(times["hf"]),
        "step_seconds": times["ours"],
        "transformers_step_seconds": times["hf"],
        "tokens_per_step": tokens,
        "flops_per_token": flops / tokens,
        "transformers_flops_per_token": hf_flops / tokens,
        "transformers_mfu": None,
        "transformers_peak_memory_bytes": None,
        "first_loss": loss,
        "transformers_first_loss": hf_loss,
    }
    if not args.no_memory:
        if args.cuda:
            result["peak_memory_bytes"] = cuda_side_peak(ours, batch)
            result["transformers_peak_memory_bytes"] = cuda_side_peak(hf, batch)
        else:
            del ours, hf  # the child processes need the memory more
            for side, key in (("ours", "peak_memory_bytes"), ("hf", "transformers_peak_memory_bytes")):
                result[key] = common.peak_memory_subprocess(
                    family, side, sargs, args.precision, threads=torch.get_num_threads()
                )
    return result


def cuda_side_peak(side: common.Side, batch) -> int:
    """Peak bytes of one side's step as if it ran alone: the step's peak above what was
    allocated before it, plus this side's own resident parameters and optimizer state."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    side.step(batch)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before + side.resident_bytes()


def generation_report(args) -> dict:
    import generation

    # The quick smoke matrix, or on CPU the whole one but batch 32 (minutes of beam search)
    argv = ["--device", args.device] + (["--quick"] if args.quick else [] if args.cuda else ["--batches", "1,8"])
    if args.threads:
        argv += ["--threads", str(args.threads)]
    with contextlib.redirect_stdout(sys.stderr):
        return generation.main(argv)


def data_prep_report(quick: bool) -> dict:
    import data_prep

    saved = sys.argv
    # data_prep.main() reads its arguments from sys.argv; its best-of-3 repeats are not needed for a smoke run
    sys.argv = ["data_prep.py", "--json"] + (["--repeat", "1"] if quick else [])
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            return data_prep.main()
    finally:
        sys.argv = saved


def _gib(x) -> str:
    return f"{x / 2**30:.2f}G" if x is not None else "-"


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if x is not None else "-"


def speedup_text(result: dict) -> str:
    """The headline ratio: the median of the alternating rounds, with their range."""
    low, high = result["speedup_range"]
    return f"{result['speedup_vs_transformers']:.2f}x ({low:.2f}-{high:.2f})"


def print_table(report: dict, out) -> None:
    peak = report["matmul_peak_flops"]
    print(
        f"device: {report['device']}; precision {report['precision_reason']}; {report['matmul_peak_dtype']} "
        f"matmul peak measured: {peak / 1e9:.1f} GFLOP/s "
        "(tok/s: fastest step; speed-up: median of adjacent-step ratios, their range in brackets)",
        file=out,
    )
    print(
        f"{'family':<9} {'precision':<18} {'ours tok/s':>11} {'hf tok/s':>10} {'speed-up (range)':>22} {'MFU':>6} "
        f"{'hf MFU':>7} {'ours mem':>9} {'hf mem':>9}  config",
        file=out,
    )
    for r in report["results"]:
        print(
            f"{r['family']:<9} {r['precision']:<18} {r['tokens_per_s']:>11.1f} "
            f"{r['transformers_tokens_per_s']:>10.1f} {speedup_text(r):>22} {_pct(r['mfu']):>6} "
            f"{_pct(r['transformers_mfu']):>7} {_gib(r['peak_memory_bytes']):>9} "
            f"{_gib(r['transformers_peak_memory_bytes']):>9}  {r['config']}",
            file=out,
        )
    gen = report.get("generation")
    if isinstance(gen, dict) and "results" in gen:
        for c in gen["results"]:
            low, high = c["ratio_range"]
            tokens = "identical tokens" if c["identical_tokens"] else f"{100 * c['token_agreement']:.1f}% same tokens"
            print(
                f"generation {c['shape']} B={c['batch']} {c['mode']} {c['dtype']} ({gen['new_tokens']} new tokens): "
                f"ours {c['tokens_per_s']:.1f} tok/s, transformers {c['transformers_tokens_per_s']:.1f} tok/s, "
                f"{c['ratio']:.2f}x ({low:.2f}-{high:.2f}), {tokens}, "
                f"{100 * c['bandwidth_utilisation']:.1f}% of memory bandwidth",
                file=out,
            )
    elif isinstance(gen, dict) and "error" in gen:
        print(f"generation: failed: {gen['error']}", file=out)
    prep = report.get("data_prep")
    if isinstance(prep, dict) and "first_run_mb_per_s" in prep:
        print(
            f"data preparation: {prep['first_run_mb_per_s']} MB/s first run ({prep['mb']} MB), "
            f"reload {prep['reload_speedup']}x faster",
            file=out,
        )


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    start = time.perf_counter()
    report = {
        "results": [],
        "matmul_peak_flops": None,
        "generation": None,
        "data_prep": None,
        "device": common.device_name(args.device),
        "precision": args.precision,
        "precision_reason": args.precision_reason,
        "torch": torch.__version__,
        "mode": args.mode,
        "targets": TARGETS,
    }
    import transformers

    report["transformers"] = transformers.__version__
    peak = make_peak(args)
    report["matmul_peak_dtype"] = str(peak.dtype).removeprefix("torch.")
    for _ in range(3):
        peak()
    log(
        f"{report['device']}: precision {args.precision_reason}; {report['matmul_peak_dtype']} matmul peak "
        f"{peak.best / 1e9:.1f} GFLOP/s (so far)"
    )
    for family in args.families:
        t0 = time.perf_counter()
        result = run_family(args, family, peak)
        report["results"].append(result)
        log(
            f"{family}: ours {result['tokens_per_s']:.1f} tok/s, transformers "
            f"{result['transformers_tokens_per_s']:.1f} tok/s ({speedup_text(result)}) "
            f"in {time.perf_counter() - t0:.0f} s"
        )
    for _ in range(3):
        peak()
    report["matmul_peak_flops"] = peak.best
    report["matmul_peak_flops_measurements"] = peak.rates
    for r in report["results"]:
        r["mfu"] = r["tokens_per_s"] * r["flops_per_token"] / peak.best
        r["transformers_mfu"] = r["transformers_tokens_per_s"] * r["transformers_flops_per_token"] / peak.best
    if not args.no_generation:
        try:
            report["generation"] = generation_report(args)
        except Exception as error:  # a benchmark section failing must not hide the others
            report["generation"] = {"error": repr(error)}
    if not args.no_data_prep:
        try:
            report["data_prep"] = data_prep_report(args.quick)
        except Exception as error:
            report["data_prep"] = {"error": repr(error)}
    report["seconds"] = time.perf_counter() - start
    print_table(report, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(common.dumps(report))
    return report


def cli(argv=None) -> int:
    """main() as a command: exit status 1 and one line on stderr when a comparison fails (no
    figure of a family whose two sides disagree is reported)."""
    try:
        main(argv)
    except common.ComparisonError as error:
        log(f"error: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
