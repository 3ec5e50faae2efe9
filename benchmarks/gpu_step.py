"""Issue #41's GPU measurements in one call: trainer.compile's whole step against transformers
compiled, float8 against bf16, and beam-4 decoding.

    python benchmarks/gpu_check.py && python benchmarks/gpu_step.py --json > gpu_step.json   # CUDA
    python benchmarks/gpu_step.py --smoke        # CPU, tiny: the float8 section end to end (float8 emulated)

Sections (each a JSON key; the tables go to stderr):
1. `training`: benchmarks/run.py --device cuda --compile (BERT, GPT-2 small, T5 at run.py's GPU
   sizes; ours with trainer.compile's whole step against transformers' `torch.compile(model)`,
   alternating steps, median speedup with its range over --rounds rounds, MFU against the measured
   bf16 matmul peak), with run.py's generation section (greedy and beam 4 tokens/s).
2. `float8`: a GPT-2-medium-shaped decoder (24 layers, d_model 1024, 16 heads, T 1024, B --batch)
   in bf16-mixed with the whole step compiled, once as is and once with trainer.float8
   (training/float8.py, torchao): step seconds over --rounds alternating rounds (the speedup is
   the median of the paired ratios, with the range), then --curve-steps optimizer steps each from
   the same initial weights on the same batches of real text (the embedded Python-stdlib corpus,
   a 50,304-token byte-level BPE trained on it first), the loss curves and the relative
   difference of their last 20 steps' mean.

Targets (the issue): GPT-2 >= 1.2x transformers compiled and >= 50% of the measured peak; BERT
>= 1.2x; T5 >= 1.0x; float8 >= 1.3x bf16 with the loss within 1% at 200 steps. The script prints
the figures; it does not judge them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repository on sys.path)

from lit_transformer.model.config import preset  # noqa: E402
from lit_transformer.objectives import CausalLM  # noqa: E402
from lit_transformer.training.float8 import convert_to_float8, float8_refusal  # noqa: E402

VOCAB = 50304  # GPT-2's 50,257 rounded up to a multiple of 64, as nanoGPT does


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def training_section(args) -> dict:
    """run.py --device cuda --compile, in a child process (its own CUDA state and compile caches)."""
    command = [sys.executable, str(Path(__file__).parent / "run.py"), "--device", args.device, "--compile", "--json"]
    command += ["--rounds", str(args.rounds), "--no-data-prep"]
    log("$", " ".join(command))
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
    if done.returncode != 0:
        return {"error": f"run.py exited with {done.returncode}"}
    return json.loads(done.stdout)


def text_rows(rows: int, length: int, max_chars: int) -> torch.Tensor:
    """(rows, length + 1) token ids of the embedded stdlib corpus, cut from one stream."""
    from tokenizers import ByteLevelBPETokenizer

    from lit_transformer.data.sources.stdlib import corpus_texts

    texts = corpus_texts("train", max_chars)
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(texts, vocab_size=50257, min_frequency=2, show_progress=False)
    ids = [i for encoding in tokenizer.encode_batch(texts) for i in encoding.ids]
    need = rows * (length + 1)
    if len(ids) < need:
        raise SystemExit(f"the stdlib corpus gave {len(ids):,} tokens; {need:,} needed (lower --curve-steps)")
    return torch.tensor(ids[:need]).view(rows, length + 1)


def decoder(args, float8: bool) -> tuple[CausalLM, torch.optim.Optimizer]:
    layers, d_model, heads = (2, 64, 4) if args.smoke else (24, 1024, 16)
    cfg = preset(
        "gpt2-small",
        n_layers=layers,
        d_model=d_model,
        n_heads=heads,
        d_ff=4 * d_model,
        vocab_size=VOCAB,
        max_seq_len=args.seq_len,
        dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)  # both sides start from the same weights
    module = CausalLM(cfg, skip_nonfinite=False, compile=not args.smoke).to(args.device)
    if float8:
        log(f"float8: {convert_to_float8(module)} linear layers converted")
    module.configure_model()
    return module, common.make_optimizer(module.parameters())


def float8_section(args) -> dict:
    reason = float8_refusal("gpu" if args.device.startswith("cuda") else "cpu")
    # --smoke runs float8 anyway: torchao's products run emulated on CPU, which checks the
    # script end to end (its speed means nothing there)
    sides = ["bf16"] if reason and not args.smoke else ["bf16", "float8"]
    if reason:
        log(f"float8 refused: {reason}" + ("; run emulated for --smoke" if args.smoke else ""))
    steps = {}
    for name in sides:
        module, optimizer = decoder(args, float8=name == "float8")
        steps[name] = (
            module,
            common._train_step(lambda b, m=module: m.training_step(b, 0), optimizer, args.device, "bf16-mixed"),
        )
    rows = text_rows(args.batch * (args.curve_steps + 1), args.seq_len, args.max_chars)
    batches = [
        {
            "input_ids": r[:, :-1].to(args.device),
            "labels": r[:, 1:].to(args.device),
            "attention_mask": torch.ones(r.shape[0], args.seq_len, dtype=torch.long, device=args.device),
        }
        for r in rows.split(args.batch)
    ]
    timing_batch, curve_batches = batches[0], batches[1:]
    result: dict = {
        "refused": reason,
        "shape": f"{'tiny' if args.smoke else 'GPT-2 medium'}, B={args.batch} T={args.seq_len}",
    }
    start = time.perf_counter()
    times = common.time_alternating(
        {n: s for n, (_, s) in steps.items()}, timing_batch, args.device, warmup=3, rounds=args.rounds
    )
    result["step_seconds"] = times
    result["tokens_per_s_median"] = {n: args.batch * args.seq_len / statistics.median(t) for n, t in times.items()}
    if "float8" in times:
        result["float8_speedup"] = common.paired_speedup(times["float8"], times["bf16"])
    log(f"timing: {time.perf_counter() - start:.0f} s; tokens/s (median) {result['tokens_per_s_median']}")
    curves = {}
    for name in sides:  # fresh weights again: the timing rounds trained them
        module, optimizer = decoder(args, float8=name == "float8")
        step = common._train_step(lambda b, m=module: m.training_step(b, 0), optimizer, args.device, "bf16-mixed")
        curves[name] = [float(step(b)) for b in curve_batches]
    result["loss_curves"] = curves
    tail = {name: statistics.fmean(c[-20:]) for name, c in curves.items()}
    result["final_loss"] = tail
    if "float8" in tail:
        result["final_loss_difference"] = tail["float8"] / tail["bf16"] - 1
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--curve-steps", type=int, default=200)
    p.add_argument("--max-chars", type=int, default=30_000_000, help="stdlib corpus characters to tokenize")
    p.add_argument("--timeout", type=int, default=420, help="seconds for run.py's section")
    p.add_argument("--skip-training", action="store_true", help="only the float8 section")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny: check the script runs")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.rounds, args.batch, args.seq_len, args.curve_steps = "cpu", 5, 2, 64, 25
        args.max_chars, args.skip_training = 2_000_000, True
    out = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    if not args.skip_training:
        out["training"] = training_section(args)
    out["float8"] = float8_section(args)
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
