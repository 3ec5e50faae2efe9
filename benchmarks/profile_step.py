"""Where a training step's time goes, ours and transformers' side by side (torch.profiler).

    python benchmarks/profile_step.py                       # GPT-2 CLM, CPU, the --quick size of run.py
    python benchmarks/profile_step.py --family t5_span --layers 12 --seq-len 512 --batch 2

Builds both sides exactly as benchmarks/run.py does (same weights, batch, precision and fused
AdamW), warms each up, then profiles `--steps` steps of each and prints, per side, the self time
of each operator group (matrix products, attention, the loss, the optimizer, norms and
activations, copies and casts, the rest) as a share of the step, then the top operators. Self
time: an operator's own time without its children, so the groups add up to the whole step.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# Operator name fragments -> group, first match wins (aten names as the profiler reports them).
GROUPS = [
    ("loss", ("cross_entropy", "log_softmax", "LogSoftmax", "nll_loss", "NllLoss")),
    (
        "attention",
        (
            "scaled_dot_product",
            "flash_attention",
            "_efficient_attention",
            "baddbmm",
            "bmm",
            "softmax_backward",
            "_softmax",
        ),
    ),
    ("matmul", ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear")),
    ("optimizer", ("adam", "_foreach")),
    ("norm + activation", ("layer_norm", "rms_norm", "gelu", "silu", "tanh", "dropout")),
    (
        "copy / cast",
        (
            "aten::copy_",
            "aten::to",
            "aten::_to_copy",
            "aten::clone",
            "aten::contiguous",
            "aten::cat",
            "aten::stack",
            "aten::index",
            "aten::fill_",
            "aten::zero_",
        ),
    ),
]


def group_of(name: str) -> str:
    for group, fragments in GROUPS:
        if any(fragment in name for fragment in fragments):
            return group
    return "other"


def profile_side(step, batch, steps: int, device: str):
    for _ in range(2):  # warm-up: allocator, autocast caches, fused-kernel selection
        step(batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(batch)
        common.sync(device)
    cuda = device.startswith("cuda")
    rows = []
    for event in prof.key_averages():
        self_us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if self_us > 0:
            rows.append((event.key, self_us / steps / 1e6, event.count // steps))
    return rows


def report(title: str, rows, top: int) -> None:
    total = sum(seconds for _, seconds, _ in rows)
    groups: dict[str, float] = defaultdict(float)
    for name, seconds, _ in rows:
        groups[group_of(name)] += seconds
    print(f"\n{title}: {total * 1e3:.0f} ms of operator self time per step")
    for group, seconds in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {group:<20} {seconds * 1e3:8.1f} ms  {seconds / total:6.1%}")
    print(f"  top {top} operators:")
    for name, seconds, calls in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"    {name:<44} {seconds * 1e3:8.1f} ms  {seconds / total:6.1%}  x{calls}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="gpt2_clm", choices=common.FAMILIES)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="bf16-mixed", choices=common.PRECISIONS)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=10)
    args = p.parse_args()

    setup = common.make_setup(args.family, layers=args.layers, seq_len=args.seq_len, batch=args.batch)
    batch = common.make_batch(setup, args.device)
    ours = common.build_ours(setup, args.device, args.precision)
    hf = common.build_hf(setup, args.device, args.precision, ours=ours.module.model)
    print(f"{args.family}: {setup.description}, {args.precision}, {torch.get_num_threads()} threads")
    report("ours", profile_side(ours.step, batch, args.steps, args.device), args.top)
    report("transformers", profile_side(hf.step, batch, args.steps, args.device), args.top)


if __name__ == "__main__":
    main()
