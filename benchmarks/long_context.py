"""Attention's cost against sequence length: full (softmax) attention, a sliding window, and
linear attention (docs/efficient-attention.md). The seed papers' claims, measured here: full
attention's time grows as T^2 (Vaswani et al. 2017, Table 1); a window of w makes it T w
(Beltagy et al. 2020); linear attention makes it T D^2 and decoding O(1) per token
(Katharopoulos et al. 2020). Memory: SDPA's fused causal kernel already keeps full attention's
activations linear in T on most devices (Dao et al. 2022), so the memory column mostly shows
the KV cache and the blocked window path not building T x T masks.

For every variant and length, a fresh process (so that one measurement's allocations cannot
hide the next one's peak) builds a small decoder (4 layers, d_model 256, 4 heads, RoPE), then:
- training step: forward + cross-entropy + backward on one row of T tokens, median of --steps
  timed steps after a warm-up step;
- peak memory: CPU, the process's resident high-water mark during the training steps less its
  resident set before building the model (/proc/self/status VmHWM); CUDA, max_memory_allocated;
- generation: a prompt of T - N tokens prefilled, then N = --new-tokens greedy steps with the
  variant's decoding state (KV cache of T, rolling cache of w, recurrent state); seconds per
  new token, prefill excluded.

    python benchmarks/long_context.py                   # 512 .. 16384 tokens, table + long_context.png
    python benchmarks/long_context.py --quick           # 512 .. 4096, fewer steps: a few minutes on 2 cores
    python benchmarks/long_context.py --json > out.json # one JSON object on stdout (the table goes to stderr)

The plot needs matplotlib (`pip install -e .[bench]`); without it the table is still printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from lit_transformer.model import LanguageModel, TransformerConfig  # noqa: E402

VARIANTS = ("full", "window", "linear")
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (512, 1024, 2048, 4096)


def model_config(variant: str, length: int, window: int, layers: int) -> TransformerConfig:
    extra = {"window": {"sliding_window": window}, "linear": {"attention_kind": "linear"}}.get(variant, {})
    return TransformerConfig(
        arch="decoder",
        vocab_size=1024,
        d_model=256,
        n_heads=4,
        n_layers=layers,
        d_ff=1024,
        max_seq_len=length,
        position="rope",
        norm="rmsnorm",
        activation="swiglu",
        bias=False,
        **extra,
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help=f"default {LENGTHS}")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--window", type=int, default=256, help="sliding window w (tokens)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per point (median)")
    parser.add_argument("--new-tokens", type=int, default=32, help="generated tokens timed per point")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS}, 1 timed step, 8 new tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--plot", default="long_context.png", help="PNG path ('' for none)")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths = args.lengths or list(QUICK_LENGTHS)
        args.steps, args.new_tokens = 1, 8
    args.lengths = args.lengths or list(LENGTHS)
    return args


# ----------------------------------------------------------------------------- one point (child process)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(variant: str, length: int, args: argparse.Namespace) -> dict:
    device = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = device == "cpu"
    warm = LanguageModel.from_config(model_config(variant, 64, args.window, 1), device=device)
    warm(torch.zeros(1, 64, dtype=torch.long, device=device)).sum().backward()  # load kernels before the baseline
    del warm
    if cpu:
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
        before = _status_kib("VmRSS")
    else:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    cfg = model_config(variant, length, args.window, args.layers)
    model = LanguageModel.from_config(cfg, device=device)
    ids = torch.randint(0, cfg.vocab_size, (1, length + 1), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")

    def step() -> None:
        with autocast:
            logits = model(ids[:, :-1])  # (1, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[0, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)

    times = []
    for i in range(1 + args.steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        if i:  # the first step warms up (allocator, kernels)
            times.append(time.perf_counter() - start)
    peak = (_status_kib("VmHWM") - before) * 1024 if cpu else torch.cuda.max_memory_allocated() - before
    return {
        "variant": variant,
        "length": length,
        "step_s": statistics.median(times),
        "peak_bytes": peak,
        "token_s": generation_time(model, ids[:, :length], args.new_tokens, device, autocast),
    }


@torch.inference_mode()
def generation_time(model: LanguageModel, ids: torch.Tensor, new_tokens: int, device: str, autocast) -> float:
    """Seconds per greedy token at context length T = ids' length: prefill T - N, decode N."""
    model.eval()
    T = ids.shape[1]
    n = min(new_tokens, T - 1)
    cache = model.transformer.new_cache(1, capacity=T)
    with autocast:
        hidden = model.transformer.decode(ids[:, : T - n], cache=cache)
        token = model.lm_head(hidden[:, -1:]).argmax(-1)  # (1, 1)
        sync(device)
        start = time.perf_counter()
        for _ in range(n):
            token = model.lm_head(model.transformer.decode(token, cache=cache)).argmax(-1)
        sync(device)
    return (time.perf_counter() - start) / n


# ----------------------------------------------------------------------------- the sweep (parent)


def run_point(variant: str, length: int, argv: list[str]) -> dict | None:
    """One point in a fresh process; None when it failed (out of memory, most likely)."""
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", variant, str(length)]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["killed"])[-1]
        print(f"  {variant} T={length}: failed ({tail})", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: list[dict], variants: list[str], lengths: list[int]) -> str:
    by = {(r["variant"], r["length"]): r for r in results}
    head = f"{'T':>6} | " + " | ".join(f"{v + ' step ms':>15} {'peak MiB':>9} {'ms/token':>9}" for v in variants)
    lines = [head, "-" * len(head)]
    for T in lengths:
        cells = []
        for v in variants:
            r = by.get((v, T))
            cells.append(
                f"{r['step_s'] * 1e3:>15.1f} {r['peak_bytes'] / 2**20:>9.0f} {r['token_s'] * 1e3:>9.2f}"
                if r
                else f"{'-':>15} {'-':>9} {'-':>9}"
            )
        lines.append(f"{T:>6} | " + " | ".join(cells))
    return "\n".join(lines)


def relative(results: list[dict], length: int) -> dict:
    """Each variant's step time and peak memory relative to full attention at `length`."""
    by = {(r["variant"], r["length"]): r for r in results}
    full = by.get(("full", length))
    if full is None:
        return {}
    return {
        v: {
            "step_time": by[(v, length)]["step_s"] / full["step_s"],
            "peak_memory": by[(v, length)]["peak_bytes"] / full["peak_bytes"],
        }
        for v in VARIANTS
        if (v, length) in by and v != "full"
    }


def plot(results: list[dict], variants: list[str], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = (
        ("step_s", "training step (s)"),
        ("peak_bytes", "peak memory (MiB)"),
        ("token_s", "generation (ms/token)"),
    )
    scale = {"step_s": 1.0, "peak_bytes": 1 / 2**20, "token_s": 1e3}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, title) in zip(axes, panels):
        for v in variants:
            points = sorted((r["length"], r[key] * scale[key]) for r in results if r["variant"] == v)
            if points:
                ax.plot(*zip(*points), marker="o", label=v)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args)))
        return 0
    report = sys.stderr if args.json else sys.stdout
    child_argv = [a for a in argv if a not in ("--json",)]
    results = []
    for variant in args.variants:
        for length in args.lengths:
            print(f"measuring {variant} T={length} ...", file=sys.stderr, flush=True)
            point = run_point(variant, length, child_argv)
            if point is None:
                break  # longer sequences would fail too
            results.append(point)
    print(table(results, args.variants, args.lengths), file=report)
    longest = max((r["length"] for r in results if r["variant"] == "full"), default=None)
    at = 8192 if 8192 in args.lengths else longest
    rel = relative(results, at) if at else {}
    for v, ratios in rel.items():
        print(
            f"{v} at T={at}: step time x{ratios['step_time']:.2f}, peak memory x{ratios['peak_memory']:.2f} "
            "relative to full attention",
            file=report,
        )
    picture = plot(results, args.variants, args.plot) if args.plot else None
    if args.plot:
        print(
            f"plot: {picture}" if picture else "plot: skipped (matplotlib is not installed: pip install -e .[bench])",
            file=report,
        )
    if args.json:
        print(
            json.dumps(
                {
                    "device": args.device,
                    "torch": torch.__version__,
                    "machine": platform.processor() or platform.machine(),
                    "threads": args.threads or torch.get_num_threads(),
                    "window": args.window,
                    "layers": args.layers,
                    "steps": args.steps,
                    "new_tokens": args.new_tokens,
                    "results": results,
                    "relative_to_full": {"length": at, **rel},
                    "plot": picture,
                }
            )
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
