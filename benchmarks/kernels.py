"""The CPU kernel choices in model/, measured again on this machine (forward + backward, the
median of --repeat runs each, after one warm-up run: the benchmarks' rule, since the best run
favours whichever kernel got lucky with the background load):

- attention (model/attention.py `_matmuls_faster`): under bf16 autocast on CPU, two batched
  matrix products and a softmax against SDPA, with no mask, a causal mask and T5's learned
  bias (for which SDPA takes its math fallback), 12 heads, D=64;
- stacked q/k/v projections (`_stack`): one product with the three weights stacked against
  three products, for a training block's tokens and for one decoding token;
- RMSNorm (model/layers.py): torch's fused `F.rms_norm` against the written-out formula, in
  float32 (where the layer uses the fused kernel).

    python benchmarks/kernels.py [--threads 1] [--repeat 5] [--json]

Not part of the test suite; benchmarks/README.md records what it printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lit_transformer.model.attention import _matmul_attention  # noqa: E402


def median_ms(step, repeat: int) -> float:
    step()  # warm-up: allocations, oneDNN primitive creation
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def attention_cases(repeat: int) -> list[dict]:
    rows = []
    for B, T, kind in (
        (2, 512, "none"),
        (2, 512, "causal"),
        (2, 512, "t5_bias"),
        (4, 256, "causal"),
        (1, 1024, "causal"),
    ):
        H, D = 12, 64
        q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
        bias = torch.randn(1, H, T, T, requires_grad=True) if kind == "t5_bias" else None
        causal = kind == "causal"

        def sdpa():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal)
            out.float().sum().backward()

        def matmuls():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = _matmul_attention(
                    q.bfloat16(), k.bfloat16(), v.bfloat16(), bias, is_causal=causal, scale=D**-0.5, dropout=0.0
                )
            out.float().sum().backward()

        rows.append(
            {
                "case": f"attention B={B} T=S={T} {kind}",
                "sdpa_ms": median_ms(sdpa, repeat),
                "matmuls_ms": median_ms(matmuls, repeat),
            }
        )
    return rows


def projection_cases(repeat: int) -> list[dict]:
    rows = []
    C = 768
    layers = [torch.nn.Linear(C, C) for _ in range(3)]
    for tokens in (1024, 1):
        x = torch.randn(1, tokens, C, requires_grad=tokens > 1)

        def separate():
            out = sum(m(x).sum() for m in layers)
            if tokens > 1:
                out.backward()

        def stacked():
            weight = torch.cat([m.weight for m in layers])
            bias = torch.cat([m.bias for m in layers])
            out = F.linear(x, weight, bias).sum()
            if tokens > 1:
                out.backward()

        with torch.set_grad_enabled(tokens > 1):
            rows.append(
                {
                    "case": f"q/k/v projections, {tokens} token(s), C={C}",
                    "separate_ms": median_ms(separate, repeat),
                    "stacked_ms": median_ms(stacked, repeat),
                }
            )
    return rows


def rms_norm_case(repeat: int) -> dict:
    x = torch.randn(8, 512, 768, requires_grad=True)
    weight = torch.ones(768, requires_grad=True)

    def fused():
        F.rms_norm(x, (768,), weight, 1e-6).sum().backward()

    def formula():
        (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).sum().backward()

    same = (
        (F.rms_norm(x, (768,), weight, 1e-6) - x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight)
        .abs()
        .max()
        .item()
    )
    return {
        "case": "RMSNorm 8 x 512 x 768 float32",
        "fused_ms": median_ms(fused, repeat),
        "formula_ms": median_ms(formula, repeat),
        "max_abs_difference": same,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.threads < 1:
        parser.error(f"--repeat {args.repeat} and --threads {args.threads} must be at least 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = attention_cases(args.repeat) + projection_cases(args.repeat) + [rms_norm_case(args.repeat)]
    if args.json:
        print(json.dumps({"threads": args.threads, "rows": rows}))
        return
    for row in rows:
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
