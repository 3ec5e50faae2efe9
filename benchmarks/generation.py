"""Decoding speed of ours against transformers' `generate`, on the same weights.

Two shapes, randomly initialised (speed does not depend on the weights), our weights copied
into transformers' model through the export mapping (common.load_ours_into_hf):
  gpt2  GPT-2 small (vocabulary 50257, d_model 768, 12 heads, d_ff 3072, learned positions)
        against GPT2LMHeadModel; 4 layers on CPU by default, 12 on CUDA.
  t5    a translator: T5-small's shape (Raffel et al. 2020: d_model 512, 8 heads, d_ff 2048,
        relative positions, tied embeddings) against T5ForConditionalGeneration; the prompt is
        the encoder input; 3+3 layers on CPU by default, 6+6 on CUDA.
Every cell (shape x batch x mode x dtype) writes exactly --new-tokens tokens per row on both
sides: no eos (ours eos_token_id=None; transformers eos_token_id=None, min_new_tokens =
max_new_tokens), beam search without early stopping. Runs alternate ours / transformers, at
least 5 rounds by default. The ratio is computed one way only: ours tokens/s over transformers'
as the table prints them (each side's median run), so every row can be checked from its own
columns; beside it the range of the per-round ratios (theirs / ours seconds of one alternating
pair), which says how much the rounds disagreed. On CPU each cell also says whether ours ran its
linear layers on oneDNN-packed weights or plain F.linear, as measured at its warm-up.

    python benchmarks/generation.py --quick        # gpt2, batches 1 and 8, greedy, 32 tokens, 5 rounds
    python benchmarks/generation.py                # the whole matrix (slow on CPU: batch 32 x beam 4)
    python benchmarks/generation.py --device cuda --json results.json
    python benchmarks/generation.py --shapes t5 --batches 8 --modes beam4 --dtypes bfloat16

bfloat16 cells are skipped on a CPU without bf16 matrix instructions (emulated there).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repository on sys.path)

from lit_transformer.model import LanguageModel, TransformerConfig, preset  # noqa: E402
from lit_transformer.model.generate import generate  # noqa: E402
from lit_transformer.model.packed_linear import measured_choice, packed_linears  # noqa: E402

SHAPES = ("gpt2", "t5")
MODES = {"greedy": 1, "beam4": 4}  # mode -> beams
DTYPES = ("float32", "bfloat16")
DEFAULTS = {"shapes": "gpt2,t5", "batches": "1,8,32", "modes": "greedy,beam4", "dtypes": "float32,bfloat16"}
DEFAULTS |= {"new_tokens": 128, "rounds": 5}
QUICK = {"shapes": "gpt2", "batches": "1,8", "modes": "greedy", "dtypes": "float32", "new_tokens": 32, "rounds": 5}
LAYERS = {"gpt2": {"cpu": 4, "cuda": 12}, "t5": {"cpu": 3, "cuda": 6}}  # per stack
WARMUP_TOKENS = 8  # a short first call per side: kernel selection and allocator, not timed


def _split(p: argparse.ArgumentParser, flag: str, text: str, allowed, kind=str) -> list:
    values = []
    for item in (s.strip() for s in text.split(",")):
        try:
            value = kind(item)
        except ValueError:
            p.error(f"{flag}: {item!r} is not a {kind.__name__}")
        if allowed is not None and value not in allowed:
            p.error(f"{flag}: unknown value {item!r}; choose from {', '.join(allowed)}")
        if kind is int and value < 1:
            p.error(f"{flag}: {item!r} must be at least 1")
        values.append(value)
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", help=f"comma-separated subset of {','.join(SHAPES)} (default {DEFAULTS['shapes']})")
    p.add_argument("--batches", help=f"comma-separated prompts per call (default {DEFAULTS['batches']})")
    p.add_argument("--modes", help=f"comma-separated subset of {','.join(MODES)} (default {DEFAULTS['modes']})")
    p.add_argument("--dtypes", help=f"comma-separated subset of {','.join(DTYPES)} (default {DEFAULTS['dtypes']})")
    p.add_argument("--new-tokens", type=int, help=f"tokens written per row (default {DEFAULTS['new_tokens']})")
    p.add_argument("--prompt-length", type=int, default=16, help="prompt (T5: encoder input) tokens per row")
    p.add_argument("--rounds", type=int, help=f"timed ours/transformers pairs per cell (default {DEFAULTS['rounds']})")
    p.add_argument("--layers", type=int, help="layers per stack for every shape (default: see the shapes)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--no-cuda-graph", dest="cuda_graph", action="store_false", help="ours without CUDA graphs (the eager step)"
    )
    p.add_argument(
        "--linears",
        choices=("measured", "packed", "plain"),
        default="measured",
        help="ours' CPU linear layers: as generate measures them on this machine (default), or forced "
        "to oneDNN-packed weights or plain F.linear, to compare the two paths",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help="also write JSON to PATH (stdout without PATH)")
    args = p.parse_args(argv)
    # --quick fills only the flags not given, so `--quick --dtypes bfloat16` keeps the dtype.
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.shapes = _split(p, "--shapes", args.shapes, SHAPES)
    args.batches = _split(p, "--batches", args.batches, None, int)
    args.modes = _split(p, "--modes", args.modes, MODES)
    args.dtypes = _split(p, "--dtypes", args.dtypes, DTYPES)
    for flag in ("new_tokens", "prompt_length", "rounds", "layers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')}: {value} must be at least 1")
    return args


def make_config(shape: str, layers: int, max_len: int) -> TransformerConfig:
    """GPT-2 small, or T5-small's shape from the T5 preset (there is no t5-small preset);
    `layers` per stack, dropout off."""
    no_dropout = {"dropout": 0.0, "attention_dropout": 0.0, "n_layers": layers}
    if shape == "gpt2":
        return preset("gpt2-small", max_seq_len=max(1024, max_len), **no_dropout)
    return preset("t5-base", d_model=512, n_heads=8, d_ff=2048, **no_dropout)


def step_bytes(model: LanguageModel, *, batch: int, beams: int, prompt_length: int, new_tokens: int) -> dict:
    """Bytes one decoding step reads, averaged over the run: every weight the step uses once
    (shared by all B x beams rows), plus each row's cached keys and values up to the current
    length. Decoder-only: step j (0..G-1) attends over P + j keys, mean P + (G-1)/2. T5: the
    decoder's own 1 + j keys, mean 1 + (G-1)/2, plus the cross-attention keys and values of
    the P encoder positions at every step. Not counted: the encoder (it runs once per call),
    the learned position table and an untied input embedding (one row per token each)."""
    cfg = model.config
    weights = 0
    for name, p in model.named_parameters():  # a tied LM head is the token table, listed once
        if name.startswith("transformer.encoder.") or ".positions." in name:
            continue
        if name == "transformer.tokens.weight" and not cfg.tie_embeddings:
            continue
        weights += p.numel() * p.element_size()
    element = next(model.parameters()).element_size()
    per_position = cfg.decoder_layers * 2 * cfg.kv_heads * cfg.dim_per_head * element  # K and V of every layer
    if cfg.arch == "encoder_decoder":
        mean_keys = 1 + (new_tokens - 1) / 2 + prompt_length
    else:
        mean_keys = prompt_length + (new_tokens - 1) / 2
    kv = batch * beams * per_position * mean_keys
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def agreement(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Fraction of new-token positions where both sides wrote the same token."""
    if ours.shape != theirs.shape:
        raise common.ComparisonError(f"ours wrote {tuple(ours.shape)} tokens, transformers {tuple(theirs.shape)}")
    return float((ours == theirs).float().mean())


def build_pair(shape: str, cfg: TransformerConfig, device: str):
    """Ours and transformers' model with the same float32 weights, in eval mode."""
    import transformers

    torch.manual_seed(0)
    ours = LanguageModel.from_config(cfg, device=device).eval()
    hf_cfg, architecture = common.hf_config(cfg)
    with torch.device(device):
        theirs = getattr(transformers, architecture)(hf_cfg)
    common.load_ours_into_hf(ours, theirs)
    theirs.eval()
    theirs.generation_config.eos_token_id = None  # no stop token: both sides write every token
    return ours, theirs


def decoders(shape: str, ours, theirs, prompt: torch.Tensor, beams: int, cuda_graph: bool = True):
    """Two functions of the number of new tokens, each returning the new tokens (B, G)."""
    P = prompt.shape[1]
    skip = 1 if shape == "t5" else P  # T5 returns the decoder start token first, GPT-2 the prompt
    start = {"decoder_start_token_id": 0} if shape == "t5" else {}
    ones = torch.ones_like(prompt)

    def run_ours(n: int) -> torch.Tensor:
        out = generate(
            ours,
            prompt,
            max_new_tokens=n,
            num_beams=beams,
            eos_token_id=None,
            pad_token_id=0,
            cuda_graph=cuda_graph,
            **start,
        )
        return out[:, skip:]

    @torch.inference_mode()
    def run_theirs(n: int) -> torch.Tensor:
        out = theirs.generate(
            input_ids=prompt,
            attention_mask=ones,
            max_new_tokens=n,
            min_new_tokens=n,
            num_beams=beams,
            do_sample=False,
            early_stopping=False,
            length_penalty=1.0,
            eos_token_id=None,
            pad_token_id=0,
            use_cache=True,
            **start,
        )
        return out[:, skip:]

    return run_ours, run_theirs


def forced_linears(run_ours, model, rows: int, path: str):
    """run_ours with its linears forced to one path. Packed: an outer packed_linears block, inside
    which generate's own is a no-op. Plain: each nn.Linear's own forward set as an instance
    attribute, which packed_linears leaves alone (it packs only modules without one)."""

    def run(n: int) -> torch.Tensor:
        if path == "packed":
            with packed_linears(model, rows, when="always"):
                return run_ours(n)
        linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
        for m in linears:
            m.forward = m.forward  # the bound nn.Linear.forward: plain F.linear, same cost
        try:
            return run_ours(n)
        finally:
            for m in linears:
                del m.forward

    return run


def timed(fn, n: int, device: str) -> tuple[float, torch.Tensor]:
    common.sync(device)
    start = time.perf_counter()
    out = fn(n)
    common.sync(device)
    return time.perf_counter() - start, out


def run_cell(args, shape: str, models, batch: int, mode: str, dtype: str, bandwidth: float) -> dict:
    ours, theirs = models
    beams, N, device = MODES[mode], args.new_tokens, args.device
    g = torch.Generator().manual_seed(batch)
    prompt = torch.randint(5, ours.config.vocab_size, (batch, args.prompt_length), generator=g).to(device)
    run_ours, run_theirs = decoders(shape, ours, theirs, prompt, beams, args.cuda_graph)
    if args.linears != "measured":
        run_ours = forced_linears(run_ours, ours, batch * beams, args.linears)
    run_ours(min(WARMUP_TOKENS, N)), run_theirs(min(WARMUP_TOKENS, N))
    # ours' CPU linears: oneDNN-packed or plain F.linear, as measured in the warm-up (packed_linear.py)
    choice = measured_choice(ours, batch * beams) if args.linears == "measured" else None
    times = {"ours": [], "theirs": []}
    for _ in range(args.rounds):  # alternating: a pair shares the machine's background load
        seconds, mine = timed(run_ours, N, device)
        times["ours"].append(seconds)
        seconds, other = timed(run_theirs, N, device)
        times["theirs"].append(seconds)
    paired = common.paired_speedup(times["ours"], times["theirs"])
    agree = agreement(mine, other)
    read = step_bytes(ours, batch=batch, beams=beams, prompt_length=args.prompt_length, new_tokens=N)
    median = {side: statistics.median(t) for side, t in times.items()}
    return {
        "shape": shape,
        "batch": batch,
        "mode": mode,
        "dtype": dtype,
        "tokens_per_s": batch * N / median["ours"],
        "transformers_tokens_per_s": batch * N / median["theirs"],
        "ratio": median["theirs"] / median["ours"],  # = the two tokens/s above, divided
        "ratio_range": [paired["min"], paired["max"]],  # of the rounds' own ratios
        "ours_linears": args.linears
        if args.linears != "measured"
        else None
        if choice is None
        else "packed"
        if choice["packed"]
        else "plain",
        "linears_measured_s": None if choice is None else [choice["packed_s"], choice["plain_s"]],
        "identical_tokens": agree == 1.0,
        "token_agreement": agree,
        "bytes_per_step": read["total"],
        "weight_bytes_per_step": read["weights"],
        "kv_bytes_per_step": read["kv_cache"],
        "bandwidth_utilisation": read["total"] * N / median["ours"] / bandwidth,
        "transformers_bandwidth_utilisation": read["total"] * N / median["theirs"] / bandwidth,
        "seconds": times["ours"],
        "transformers_seconds": times["theirs"],
    }


def print_cells(report: dict, out=None) -> None:
    out = out or sys.stdout  # looked up at call time, so that run.py's redirect_stdout applies
    print(
        f"{report['device']}, torch {report['torch']}, transformers {report['transformers']}; "
        f"{report['new_tokens']} new tokens after a {report['prompt_length']}-token prompt; measured memory "
        f"bandwidth {report['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (streaming read, best of "
        f"{len(report['memory_bandwidth_measurements'])}); ratio: ours tok/s / hf tok/s, each the median of "
        f"{report['rounds']} alternating rounds (range: the lowest and highest ratio of one round)",
        file=out,
    )
    for shape, description in report["models"].items():
        print(f"  {shape}: {description}", file=out)
    print(
        f"{'shape':<5} {'batch':>5} {'mode':<6} {'dtype':<8} {'ours tok/s':>10} {'hf tok/s':>9} "
        f"{'ratio (range)':>19} {'tokens':>9} {'MB/step':>8} {'bw ours':>7} {'bw hf':>6} {'linears':>7}",
        file=out,
    )
    for c in report["results"]:
        low, high = c["ratio_range"]
        ratio = f"{c['ratio']:.2f}x ({low:.2f}-{high:.2f})"
        tokens = "same" if c["identical_tokens"] else f"{100 * c['token_agreement']:.1f}%"
        print(
            f"{c['shape']:<5} {c['batch']:>5} {c['mode']:<6} {c['dtype']:<8} {c['tokens_per_s']:>10.1f} "
            f"{c['transformers_tokens_per_s']:>9.1f} {ratio:>19} "
            f"{tokens:>9} {c['bytes_per_step'] / 1e6:>8.1f} {100 * c['bandwidth_utilisation']:>6.1f}% "
            f"{100 * c['transformers_bandwidth_utilisation']:>5.1f}% {c['ours_linears'] or '-':>7}",
            file=out,
        )
    for note in report["skipped"]:
        print(f"skipped: {note}", file=out)
    for c in report["results"]:  # float32 greedy has no near-tie rounding to excuse a difference
        if c["dtype"] == "float32" and c["mode"] == "greedy" and not c["identical_tokens"]:
            print(
                f"warning: {c['shape']} B={c['batch']} float32 greedy tokens differ from transformers' "
                f"({100 * c['token_agreement']:.1f}% agree): check that both compute the same model",
                file=out,
            )


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    cuda = args.device.startswith("cuda")
    bandwidth = common.memory_bandwidth(args.device)
    report = {
        "device": common.device_name(args.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "new_tokens": args.new_tokens,
        "prompt_length": args.prompt_length,
        "rounds": args.rounds,
        "cuda_graph": args.cuda_graph and cuda,
        "memory_bandwidth_bytes_per_s": max(bandwidth),
        "memory_bandwidth_measurements": bandwidth,
        "models": {},
        "results": [],
        "skipped": [],
    }
    native_bf16 = common.bf16_is_native(args.device)
    for shape in args.shapes:
        layers = args.layers or LAYERS[shape]["cuda" if cuda else "cpu"]
        cfg = make_config(shape, layers, args.prompt_length + args.new_tokens)
        base = build_pair(shape, cfg, args.device)
        stacks = f"{layers}+{layers} layers" if cfg.arch == "encoder_decoder" else f"{layers} layers"
        report["models"][shape] = (
            f"{stacks}, d_model {cfg.d_model}, {cfg.n_heads} heads, d_ff {cfg.d_ff}, vocab {cfg.vocab_size}, "
            f"{sum(p.numel() for p in base[0].parameters()) / 1e6:.1f}M parameters"
        )
        for dtype in args.dtypes:
            if dtype == "bfloat16" and not native_bf16:
                report["skipped"].append(
                    f"{shape} bfloat16: this CPU has no bf16 matrix instructions (AMX, AVX512-BF16); emulated bf16 "
                    "would measure the emulation"
                )
                continue
            models = base if dtype == "float32" else tuple(copy.deepcopy(m).to(getattr(torch, dtype)) for m in base)
            for batch in args.batches:
                for mode in args.modes:
                    cell = run_cell(args, shape, models, batch, mode, dtype, max(bandwidth))
                    report["results"].append(cell)
                    print(
                        f"{shape} B={batch} {mode} {dtype}: ours {cell['tokens_per_s']:.1f} tok/s, transformers "
                        f"{cell['transformers_tokens_per_s']:.1f} tok/s, ratio {cell['ratio']:.2f}x",
                        file=sys.stderr,
                        flush=True,
                    )
            del models
    print_cells(report)
    if args.json == "-":
        print(json.dumps(report, indent=2))
    elif args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
