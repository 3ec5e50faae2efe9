"""Generation over many inputs without a trained run: token-sized batches (plan_batches), a batch
decoding each prompt as it would be decoded alone, the prompt joined to its continuation, the
decoding dtype, and the batching flags' errors. The end-to-end runs are in test_translation.py."""

from __future__ import annotations

import pytest
import torch
from helpers import seeded_model, tiny_config
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from lit_transformer.commands.cli import build_parser, main
from lit_transformer.data.tokens.tokenizer import SpecialTokens
from lit_transformer.errors import RunError
from lit_transformer.evaluation.batch_generate import (
    BATCH_ROWS,
    BATCH_TOKENS,
    BatchGenerator,
    Decoding,
    decoding_device,
    decoding_dtype,
    plan_batches,
)
from lit_transformer.evaluation.prompts import with_prompt

WORDS = "open read the file and return its lines as a list of strings for every path".split()


def word_tokenizer() -> Tokenizer:
    """One token per word of WORDS, then <pad> and </s> (pad and eos = the decoder's separator)."""
    vocab = {w: i for i, w in enumerate([*WORDS, "<unk>", "<pad>", "</s>"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<pad>", "</s>"])
    return tokenizer


@pytest.mark.parametrize("num_beams", [1, 3])
def test_plan_batches_respects_the_token_and_row_limits(num_beams):
    lengths = [7, 3, 11, 1, 5, 9, 2, 13, 4, 6, 8, 10, 12]
    budget = lambda n: 17 if n < 10 else 5  # noqa: E731  two budgets: a batch never mixes them
    batches = plan_batches(lengths, budget, batch_size=4, batch_tokens=101, num_beams=num_beams)
    assert sorted(i for rows in batches for i in rows) == list(range(len(lengths)))  # each once
    flat = [lengths[i] for rows in batches for i in rows]
    assert flat == sorted(lengths, reverse=True)  # longest first
    for rows, after in zip(batches, [*batches[1:], None]):
        longest = max(lengths[i] for i in rows)
        assert lengths[rows[0]] == longest and len({budget(lengths[i]) for i in rows}) == 1
        assert len(rows) <= 4
        row_tokens = (longest + budget(longest)) * num_beams
        assert len(rows) * row_tokens <= 101 or len(rows) == 1, rows  # over the limit only alone
        if after is not None and len(rows) < 4 and budget(lengths[after[0]]) == budget(longest):
            assert (len(rows) + 1) * row_tokens > 101, rows  # full: the next prompt would not have fitted
    assert max(len(rows) for rows in batches) > 1
    if num_beams == 3:  # (13 + 5) * 3 = 54 tokens a row: one at a time at the top
        assert [len(rows) for rows in batches[:2]] == [1, 1]


def test_plan_batches_fills_each_batch_and_caps_rows():
    lengths = [3] * 10
    assert [len(b) for b in plan_batches(lengths, lambda n: 4, batch_size=None, batch_tokens=15)] == [2] * 5
    assert [len(b) for b in plan_batches(lengths, lambda n: 4, batch_size=3, batch_tokens=None)] == [3, 3, 3, 1]
    assert [len(b) for b in plan_batches(lengths, lambda n: 4, batch_size=None, batch_tokens=None)] == [10]
    assert [len(b) for b in plan_batches([50, 2], lambda n: 4, batch_size=8, batch_tokens=20)] == [1, 1]


@pytest.mark.parametrize("num_beams", [1, 2])
def test_token_batches_decode_each_prompt_as_alone(num_beams):
    """Prompts of shuffled lengths in token-sized batches give the text of batch size 1 (greedy)."""
    tokenizer = word_tokenizer()
    special = SpecialTokens.from_tokenizer(tokenizer)
    model = seeded_model(tiny_config(vocab_size=tokenizer.get_vocab_size(), max_seq_len=40), seed=3)
    decoding = Decoding(max_new_tokens=6, num_beams=num_beams)
    texts = [" ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(n)) for i, n in enumerate([5, 1, 9, 3, 7, 2, 4])]
    alone = BatchGenerator(model, tokenizer, special, "continue", decoding, batch_size=1)
    batched = BatchGenerator(model, tokenizer, special, "continue", decoding, batch_size=None, batch_tokens=37)
    expected = alone(texts)
    assert batched(texts) == expected
    assert len(set(expected)) > 2  # outputs differ from prompt to prompt, so a mix-up would show
    shown = BatchGenerator(model, tokenizer, special, "continue", decoding, batch_tokens=37, show_prompt=True)
    for text, out, new in zip(texts, shown(texts), expected):
        assert out == f"{text} {new}".strip()
    rates = batched.throughput()
    assert batched.inputs == len(texts) and 0 < batched.new_tokens <= len(texts) * 6
    assert rates["tokens_per_s"] > 0 and rates["sentences_per_s"] > 0


def test_prompt_and_continuation_are_decoded_together():
    """A WordPiece continuation "##ine" after "def" is "define", not "def ine"; the prompt is
    shown as written where its tokens decode to other text (a normalising tokenizer's)."""
    vocab = {t: i for i, t in enumerate(["[UNK]", "[PAD]", "[SEP]", "def", "##ine", "read"])}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(["[PAD]", "[SEP]"])
    special = SpecialTokens.from_tokenizer(tokenizer)
    assert with_prompt(tokenizer, special, "def", [2, 3], [4, 2, 1]) == "define"  # stops at [SEP]
    assert with_prompt(tokenizer, special, "Def", [2, 3], [5, 1, 1]) == "Def read"
    assert with_prompt(tokenizer, special, "def", [2, 3], [2, 5]) == "def"


def test_auto_dtype_is_bf16_only_where_it_is_fast(monkeypatch):
    from lit_transformer import machine

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for flags, expected in (({"avx2", "amx_bf16"}, torch.bfloat16), ({"avx512_bf16"}, torch.bfloat16)):
        monkeypatch.setattr(machine, "cpu_flags", lambda flags=flags: flags)
        assert decoding_dtype("auto", cpu) == expected
    monkeypatch.setattr(machine, "cpu_flags", lambda: {"avx2", "avx512f"})
    assert decoding_dtype("auto", cpu) == torch.float32
    assert decoding_dtype("auto", cuda) == torch.bfloat16
    assert decoding_dtype("bfloat16", cpu) == torch.bfloat16 and decoding_dtype("float32", cuda) == torch.float32
    with pytest.raises(RunError, match="--dtype float16: choose auto, float32 or bfloat16"):
        decoding_dtype("float16", cpu)


def test_auto_device_is_the_gpu_where_torch_sees_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert decoding_device("auto") == decoding_device("cpu") == torch.device("cpu")
    with pytest.raises(RunError, match="--device cuda: torch sees no CUDA device on this machine"):
        decoding_device("cuda")
    with pytest.raises(RunError, match="--device tpu: choose auto, cpu or cuda"):
        decoding_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert decoding_device("auto") == decoding_device("cuda") == torch.device("cuda")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_both_dtypes_generate(dtype):
    tokenizer = word_tokenizer()
    special = SpecialTokens.from_tokenizer(tokenizer)
    model = seeded_model(tiny_config(vocab_size=tokenizer.get_vocab_size(), max_seq_len=40)).to(DTYPE[dtype])
    generate = BatchGenerator(model, tokenizer, special, "continue", Decoding(max_new_tokens=5))
    out = generate(["open the file", "read"])
    assert len(out) == 2 and generate.new_tokens > 0 and str(generate.dtype) == f"torch.{dtype}"


DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def test_flag_defaults_and_errors(tmp_path, capsys):
    parser = build_parser()
    for command in (["generate", "run", "--prompt", "x"], ["evaluate", "run"]):
        args = parser.parse_args(command)  # cli.py avoids importing torch: its defaults are copies
        assert (args.batch_size, args.batch_tokens, args.dtype, args.device) == (
            BATCH_ROWS,
            BATCH_TOKENS,
            "auto",
            "auto",
        )
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "run", "--prompt", "x", "--dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err
    source = tmp_path / "in.txt"
    source.write_text("a\n")
    for argv in (["generate", "no-run", "--input", str(source)], ["evaluate", "no-run"]):
        assert main([*argv, "--batch-tokens", "0"]) == 2
        assert capsys.readouterr().err == "error: --batch-tokens 0 must be at least 1\n"  # before the run is read
