"""The row-mixed path's collation on the CPU (issue #52): the mntp collator alone and a whole
RowMixtureBatches batch (each row's generator, each task's collator, the stacking), for
tiny-gptbert's shape (16 rows of 129 tokens, 12 causal and 4 mntp, vocabulary 2000) and for
16 mntp rows (GPT-BERT's 1:15 leans that way); and the decoder's prefix-LM collator (UniLM's
and UL2's rows on a decoder) over 16 blocks.

    python benchmarks/collate_speed.py [--rounds 7] [--calls 200] [--threads 1] [--json]

Each case runs `--calls` calls per round after a warm-up, and reports the median time per call
over `--rounds` rounds with the range (the benchmarks' rule). Every call gets fresh generators,
built outside the timed loop for the collator cases (a generator's draws change its state) and
inside it for RowMixtureBatches, which builds them itself. One torch thread by default, as in a
DataLoader worker. Not part of the test suite; benchmarks/README.md records what it printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lit_transformer.data.batches.collate import CLMCollator, example_generators  # noqa: E402
from lit_transformer.data.batches.mntp import MNTPCollator  # noqa: E402
from lit_transformer.data.batches.prefix import DecoderPrefixCollator, TaskCollator  # noqa: E402
from lit_transformer.data.batches.row_mixing import RowMixtureBatches  # noqa: E402
from lit_transformer.data.tokens.tokenizer import SpecialTokens  # noqa: E402

SPECIAL = SpecialTokens(pad_id=0, unk_id=1, bos_id=2, eos_id=3, cls_id=4, sep_id=5, mask_id=6)
VOCAB, BLOCK, ROWS = 2000, 129, 16  # tiny-gptbert: block_size 128 (+1 for the shifted targets), batch 16
EXAMPLES = 4096  # blocks per task, so the calls walk over different rows


def blocks(seed: int) -> list[np.ndarray]:
    """Packed blocks as LMBlocks returns them (int64 arrays), with a separator now and then."""
    rng = np.random.default_rng(seed)
    out = rng.integers(7, VOCAB, size=(EXAMPLES, BLOCK))
    out[rng.random(out.shape) < 0.05] = SPECIAL.eos_id
    return list(out)


def mntp() -> MNTPCollator:
    return MNTPCollator(special=SPECIAL, vocab_size=VOCAB, mask_rate_start=0.3, mask_rate_end=0.15)


def timed(call, calls: int, rounds: int) -> dict:
    """Median and range over rounds of the mean time per call, in microseconds."""
    call(0)  # warm-up
    per_call = []
    for r in range(rounds):
        start = time.perf_counter()
        for i in range(calls):
            call(1 + r * calls + i)
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    return {"median_us": statistics.median(per_call), "min_us": min(per_call), "max_us": max(per_call)}


def collator_case(rows: int, calls: int, rounds: int) -> dict:
    data, collator = blocks(0), mntp()
    gens = [example_generators(0, 0, range(i * rows, (i + 1) * rows)) for i in range(1 + rounds * calls)]

    def call(i):
        first = (i * rows) % (EXAMPLES - rows)
        collator(data[first : first + rows], gens[i], i % 1000 / 1000)  # the share of the run done

    return timed(call, calls, rounds)


def prefix_case(rows: int, calls: int, rounds: int) -> dict:
    data, collator = blocks(0), DecoderPrefixCollator(SPECIAL, 0.5)
    gens = [example_generators(0, 0, range(i * rows, (i + 1) * rows)) for i in range(1 + rounds * calls)]

    def call(i):
        first = (i * rows) % (EXAMPLES - rows)
        collator(data[first : first + rows], gens[i])

    return timed(call, calls, rounds)


def row_mixture_case(mntp_rows: int, calls: int, rounds: int) -> dict:
    collators = [
        TaskCollator(CLMCollator(special=SPECIAL), task=0, objective="clm", arch="decoder"),
        TaskCollator(mntp(), task=1, objective="mntp", arch="decoder"),
    ]
    dataset = RowMixtureBatches([blocks(0), blocks(1)], collators, seed=0)
    split = [(0, ROWS - mntp_rows), (1, mntp_rows)]

    def call(i):
        parts = tuple((t, tuple((0, (i * ROWS + j) % EXAMPLES) for j in range(rows))) for t, rows in split if rows)
        dataset[parts, i % 1000 / 1000]  # the share of the run done

    return timed(call, calls, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = {
        "mntp collator, 4 rows": lambda: collator_case(4, args.calls, args.rounds),
        "mntp collator, 16 rows": lambda: collator_case(16, args.calls, args.rounds),
        "prefix-LM collator, 16 rows": lambda: prefix_case(16, args.calls, args.rounds),
        "RowMixtureBatches, 12 clm + 4 mntp": lambda: row_mixture_case(4, args.calls, args.rounds),
        "RowMixtureBatches, 16 mntp": lambda: row_mixture_case(16, args.calls, args.rounds),
    }
    results = {name: case() for name, case in cases.items()}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{'case':<38} {'median us':>10} {'min':>10} {'max':>10}")
    for name, r in results.items():
        print(f"{name:<38} {r['median_us']:>10.0f} {r['min_us']:>10.0f} {r['max_us']:>10.0f}")


if __name__ == "__main__":
    main()
