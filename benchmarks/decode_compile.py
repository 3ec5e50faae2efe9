"""One decoding step three ways: eager with plain F.linear, eager with oneDNN-packed weights
(what `generate` does on CPU where they measure faster, model/packed_linear.py), and `torch.compile` of the decoder's
`decode` (dynamic shapes, inductor; `--freezing` turns on inductor's weight freezing). GPT-2
small shape, greedy, batch 1, float32 by default: the steady tokens/s after the first two steps
(which include compiling), and whether the compiled step wrote the eager step's tokens.

    python benchmarks/decode_compile.py              # about a minute on 2 cores, most of it compiling
    python benchmarks/decode_compile.py --freezing --layers 4 --new-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lit_transformer.model import LanguageModel, preset  # noqa: E402
from lit_transformer.model.generate import StepDecoder  # noqa: E402
from lit_transformer.model.packed_linear import packed_linears  # noqa: E402


def steady_rate(model: LanguageModel, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float, torch.Tensor]:
    """(seconds of the first two steps, tokens/s of the rest, the sequences) of greedy decoding."""
    with torch.inference_mode():
        decoder = StepDecoder(model, prompt, max_new_tokens=new_tokens)
        start = time.perf_counter()
        for step in range(new_tokens):
            decoder.append(decoder.next_logits().argmax(-1))
            if step == 1:
                first, steady_start = time.perf_counter() - start, time.perf_counter()
        rate = (new_tokens - 2) * prompt.shape[0] / (time.perf_counter() - steady_start)
    return first, rate, decoder.sequences.clone()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--freezing", action="store_true", help="inductor's weight freezing")
    args = parser.parse_args(argv)
    if args.new_tokens < 3:
        parser.error(f"--new-tokens {args.new_tokens}: at least 3 (two warm-up steps, then the timed ones)")
    cfg = preset("gpt2-small", n_layers=args.layers, dropout=0.0, attention_dropout=0.0, max_seq_len=1024)
    torch.manual_seed(0)
    model = LanguageModel.from_config(cfg).eval().to(getattr(torch, args.dtype))
    prompt = torch.randint(0, cfg.vocab_size, (1, 16))
    _, eager_rate, eager = steady_rate(model, prompt, args.new_tokens)
    with packed_linears(model, when="always"):  # the packed path itself, not generate's measured choice
        _, packed_rate, _ = steady_rate(model, prompt, args.new_tokens)
    import torch._inductor.config as inductor_config

    inductor_config.freezing = args.freezing
    model.transformer.decode = torch.compile(model.transformer.decode, dynamic=True)
    first, compiled_rate, compiled = steady_rate(model, prompt, args.new_tokens)
    print(
        f"gpt2-small shape, {args.layers} layers, {args.dtype}, batch 1, {args.new_tokens} tokens, "
        f"{torch.get_num_threads()} threads: eager {eager_rate:.1f} tok/s, eager packed {packed_rate:.1f} tok/s, "
        f"compiled{' (freezing)' if args.freezing else ''} {compiled_rate:.1f} tok/s after {first:.1f} s for "
        f"the first two steps; compiled tokens {'equal' if torch.equal(compiled, eager) else 'DIFFER from'} eager's"
    )


if __name__ == "__main__":
    main()
