"""Generation speed with and without the KV cache (the target: the cache is at least 5x
faster than recomputing the whole sequence every step, for 512 new tokens).

A GPT-2-small-class decoder (vocabulary 50257, d_model 768, 12 heads, d_ff 3072, learned
positions), randomly initialised: speed does not depend on the weights. Greedy decoding with
no eos, so every run writes exactly --new-tokens tokens. On CPU the default is 4 layers
instead of 12, because recomputation costs O(n^2) layer passes and would take minutes on a
2-core machine; the per-token LM head (768 x 50257), identical in both modes, then weighs more,
which makes the measured speed-up smaller than with 12 layers, not larger.

    python benchmarks/generation.py                # CPU: 4 layers, 512 new tokens
    python benchmarks/generation.py --quick        # 2 layers, 64 new tokens: a smoke run
    python benchmarks/generation.py --device cuda --layers 12 --json results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lit_transformer.model import LanguageModel, preset  # noqa: E402
from lit_transformer.model.generate import generate  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 12 on GPU, 4 on CPU)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per mode; the fastest is reported")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--quick", action="store_true", help="2 layers, 64 new tokens")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="also write the results as JSON to PATH (or stdout without PATH)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.new_tokens = args.layers or 2, 64
    if args.layers is None:
        args.layers = 12 if args.device.startswith("cuda") else 4
    return args


def timed(fn) -> tuple[float, torch.Tensor]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cfg = preset(
        "gpt2-small",
        n_layers=args.layers,
        dropout=0.0,
        attention_dropout=0.0,
        max_seq_len=max(1024, args.prompt_length + args.new_tokens),
    )
    torch.manual_seed(0)
    model = LanguageModel.from_config(cfg, device=args.device).to(dtype).eval()
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_length), device=args.device)

    results, outputs = {}, {}
    for use_cache in (True, False):
        generate(model, prompt, max_new_tokens=8, use_cache=use_cache)  # warm-up: kernels, allocator
        best = float("inf")
        for _ in range(args.repeats):
            seconds, out = timed(lambda: generate(model, prompt, max_new_tokens=args.new_tokens, use_cache=use_cache))
            best = min(best, seconds)
        outputs[use_cache] = out
        mode = "kv_cache" if use_cache else "recompute"
        results[mode] = {"seconds": best, "tokens_per_s": args.batch * args.new_tokens / best}
    speedup = results["recompute"]["seconds"] / results["kv_cache"]["seconds"]
    report = {
        "model": f"gpt2-small-class, {args.layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "batch": args.batch,
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "torch": torch.__version__,
        **results,
        "speedup": speedup,
        "same_tokens": bool(torch.equal(outputs[True], outputs[False])),
        "target_speedup": 5.0,
        "meets_target": speedup >= 5.0,
    }
    print(
        f"{report['model']}, {report['parameters'] / 1e6:.1f}M parameters, {report['device']} "
        f"({report['threads']} threads), {args.dtype}, batch {args.batch}, prompt {args.prompt_length}, "
        f"{args.new_tokens} new tokens"
    )
    print(f"{'mode':<12}{'seconds':>10}{'tokens/s':>12}")
    for mode in ("kv_cache", "recompute"):
        print(f"{mode:<12}{results[mode]['seconds']:>10.2f}{results[mode]['tokens_per_s']:>12.1f}")
    print(
        f"speed-up {speedup:.1f}x (target >= 5x: {'met' if report['meets_target'] else 'NOT met'}); "
        f"identical tokens: {report['same_tokens']}"
    )
    if args.json == "-":
        print(json.dumps(report, indent=2))
    elif args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
