"""Translation end to end: batched beam search equals one sentence at a time, GNMT
length normalisation, `generate --input` in input order, context limits said out loud,
checkpoint averaging, and evaluate's BLEU equal to sacrebleu on `generate --input`'s output.

Tiny random models with odd sizes (vocabulary 99, prompt lengths 7, 3, 5, 1); init_std raised
so that beams differ and stay away from ties.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from helpers import RECIPES, SMALL, seeded_model, tiny_config  # SMALL: the CLI tests' tiny-run settings

from lit_transformer.commands.cli import main
from lit_transformer.model import TransformerConfig
from lit_transformer.model.generate import generate

V = 99
LENGTHS = (7, 3, 5, 1)
PAD = 0
EOS = list(range(2, 14))  # a dozen eos ids: hypotheses end at different lengths, so length penalties matter

pytestmark = pytest.mark.usefixtures("one_thread")


def config(arch: str) -> TransformerConfig:
    extra = dict(position="sinusoidal", norm_position="post") if arch == "encoder_decoder" else dict(position="rope")
    return tiny_config(arch, vocab_size=V, init_std=0.3, **extra)


def batch(lengths=LENGTHS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(14, V, (n,), generator=g).tolist() for n in lengths]


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and mask; generate accepts either side."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return ids, mask


def new_tokens(model, out: torch.Tensor, width: int, row: int) -> list[int]:
    """The generated ids of one output row, up to and including eos."""
    new = out[row, 1:] if model.config.arch == "encoder_decoder" else out[row, width:]
    ids = []
    for t in new.tolist():
        ids.append(t)
        if t in EOS:
            break
    return ids if ids[-1] in EOS else [t for t in ids if t != PAD]


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder"])
@pytest.mark.parametrize("normalization,alpha", [("gnmt", 0.6), ("power", 1.0), ("gnmt", 0.0)])
def test_batched_beam_search_equals_one_at_a_time(arch, normalization, alpha):
    model = seeded_model(config(arch))
    rows = batch()
    options = dict(
        max_new_tokens=9,
        num_beams=3,
        length_penalty=alpha,
        length_normalization=normalization,
        eos_token_id=EOS,
        pad_token_id=PAD,
        decoder_start_token_id=PAD,
    )
    ids, mask = padded(rows)
    together = generate(model, ids, mask, **options)
    for i, row in enumerate(rows):
        alone = generate(model, torch.tensor([row]), **options)
        assert new_tokens(model, together, ids.shape[1], i) == new_tokens(model, alone, len(row), 0), i


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder"])
def test_beam_width_one_equals_greedy_in_a_padded_batch(arch):
    model = seeded_model(config(arch), seed=3)
    ids, mask = padded(batch(seed=4))
    common = dict(max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD, decoder_start_token_id=PAD)
    greedy = generate(model, ids, mask, **common)
    beam1 = generate(model, ids, mask, num_beams=1, length_penalty=0.6, length_normalization="gnmt", **common)
    assert torch.equal(greedy, beam1)


def test_gnmt_normalisation_prefers_longer_hypotheses_than_none():
    """alpha = 0 scores by summed log-probability (short hypotheses win); GNMT's alpha > 0
    divides by ((5 + |Y|) / 6) ** alpha, so hypotheses can only get longer on average."""
    model = seeded_model(config("encoder_decoder"), seed=5)
    ids, mask = padded(batch((6, 4, 5, 3, 7, 2), seed=6))
    common = dict(
        max_new_tokens=12,
        num_beams=4,
        eos_token_id=EOS,
        pad_token_id=PAD,
        decoder_start_token_id=PAD,
        length_normalization="gnmt",
    )
    short = generate(model, ids, mask, length_penalty=0.0, **common)
    long = generate(model, ids, mask, length_penalty=2.0, **common)
    length = lambda out: sum(len(new_tokens(model, out, 0, i)) for i in range(out.shape[0]))  # noqa: E731
    assert length(long) >= length(short)


# ----------------------------------------------------------------------------- end to end on tiny runs


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """A seq2seq run keeping three checkpoints, and a clm run; {name: run dir}. A small learning
    rate keeps them near their random start, whose outputs differ from input to input."""
    root = tmp_path_factory.mktemp("translation_runs")
    mp = pytest.MonkeyPatch()
    mp.setenv("LIT_TRANSFORMER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    extra = {
        "tiny-seq2seq": [
            "trainer.max_steps=6",
            "trainer.checkpoint_every_n_steps=2",
            "trainer.keep_checkpoints=3",
            "trainer.val_check_interval=6",
            "tokenizer.vocab_size=400",
        ],
        "tiny-clm": ["tokenizer.vocab_size=400"],
    }
    try:
        for name, more in extra.items():
            args = [
                "pretrain",
                str(RECIPES / f"{name}.yaml"),
                *SMALL,
                *more,
                "optim.lr=1e-5",
                "model.init_std=0.3",
                f"run.dir={root / name}",
            ]
            assert main(args) == 0
    finally:
        torch.set_num_threads(threads)
        mp.undo()
    return {name: root / name for name in extra}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-seq2seq", "tiny-clm"])
def test_generate_input_writes_outputs_in_input_order(name, tiny_runs, tmp_path, capsys):
    """Shuffled lengths, batches of 3 inputs or of 37 tokens, sorted by length inside chunks of 4:
    each output line equals the output of its input alone (greedy and beam search), in input
    order; a decoder's --input lines and an encoder-decoder's --prompt output hold no prompt."""
    words = "open read the file and return its lines as a list of strings".split()
    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(n)) for n in (9, 1, 5, 12, 3, 7, 2, 10)]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n")
    from lit_transformer.evaluation import batch_generate

    alone_only = ["--continuation-only"] if name == "tiny-clm" else []  # the flag changes nothing for seq2seq
    for beams in ("1", "3"):
        outputs = []
        for batching in (["--batch-size", "3"], ["--batch-tokens", "37"]):
            out = tmp_path / f"out{beams}.txt"
            argv = [
                "generate",
                str(tiny_runs[name]),
                "--input",
                str(source),
                "--output",
                str(out),
                *batching,
                "--max-new-tokens",
                "6",
                "--greedy",
                "--num-beams",
                beams,
            ]
            chunk = batch_generate.CHUNK_LINES
            batch_generate.CHUNK_LINES = 4  # several chunks: sorting happens inside each
            try:
                assert main(argv) == 0
            finally:
                batch_generate.CHUNK_LINES = chunk
            outputs.append(out.read_text())
            assert re.search(
                r"^generate: 8 inputs in \d+\.\d s \((bfloat16|float32)\): [\d.]+ sentences/s, \d+ new tokens/s$",
                capsys.readouterr().err,
                re.M,
            )
        assert outputs[0] == outputs[1]
        got = outputs[0].split("\n")
        assert got[-1] == "" and len(got) == len(lines) + 1
        assert len(set(got)) > 3  # outputs that differ, so that an order mix-up shows
        for line, output in zip(lines, got):
            assert (
                main(
                    [
                        "generate",
                        str(tiny_runs[name]),
                        "--prompt",
                        line,
                        "--max-new-tokens",
                        "6",
                        "--greedy",
                        "--num-beams",
                        beams,
                        *alone_only,
                    ]
                )
                == 0
            )
            assert batch_generate.one_line(capsys.readouterr().out[:-1]) == output


@pytest.mark.slow
def test_a_decoders_prompt_output_starts_with_the_prompt(tiny_runs, capsys):
    prompt = "def read(self, size"
    args = ["generate", str(tiny_runs["tiny-clm"]), "--prompt", prompt, "--max-new-tokens", "6", "--greedy"]
    assert main([*args, "--dtype", "float32"]) == 0
    shown = capsys.readouterr().out[:-1]
    assert main([*args, "--dtype", "float32", "--continuation-only"]) == 0
    new = capsys.readouterr().out[:-1]
    assert shown.startswith(prompt) and not new.startswith(prompt) and new.strip()
    assert shown == prompt + new  # byte-level BPE: the joint decoding is the concatenation
    assert main([*args, "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.startswith(prompt)


@pytest.mark.slow
def test_generate_input_jsonl_column_and_bad_inputs(tiny_runs, tmp_path, capsys):
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "src": s}) + "\n" for i, s in enumerate(["a b c", "def f", "x"])))
    out = tmp_path / "out.jsonl"
    run = str(tiny_runs["tiny-seq2seq"])
    assert main(["generate", run, "--input", str(rows), "--column", "src", "--output", str(out), "--greedy"]) == 0
    assert [json.loads(line)["input"] for line in out.read_text().splitlines()] == ["a b c", "def f", "x"]
    assert main(["generate", run, "--input", str(rows), "--greedy"]) == 2  # no source/text column
    assert "row 1 has no column 'text'" in capsys.readouterr().err
    assert main(["generate", run, "--input", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt: no such file" in capsys.readouterr().err


@pytest.mark.slow
def test_prompt_longer_than_the_context_continues_its_tail(tiny_runs, capsys):
    from lit_transformer.commands.inference import text_generator
    from lit_transformer.evaluation.batch_generate import BatchGenerator, Decoding
    from lit_transformer.evaluation.prompts import complete, encode_prompt

    run = str(tiny_runs["tiny-clm"])
    text = " ".join(f"value_{i} = read(path, {i})" for i in range(40))  # far more than 32 tokens
    generate_text: BatchGenerator = text_generator(run, Decoding(max_new_tokens=8))
    (got,) = generate_text([text])
    err = capsys.readouterr().err
    ids = encode_prompt(text, generate_text.tokenizer, generate_text.special, "continue")
    assert f"input 1 has {len(ids)} tokens, more than the model's context (32) holds: kept its last 24" in err
    tail = ids[-24:]
    (expected,) = complete(
        generate_text.model,
        generate_text.tokenizer,
        generate_text.special,
        "continue",
        [tail],
        max_new_tokens=8,
        do_sample=False,
    )
    assert got == expected
    # asking for more new tokens than the context holds: capped, and said
    assert main(["generate", run, "--prompt", "def ", "--max-new-tokens", "100000", "--greedy"]) == 0
    assert "generation stops at the context length: max_new_tokens=100000" in capsys.readouterr().err


@pytest.mark.slow
def test_average_is_the_elementwise_mean_and_one_is_the_identity(tiny_runs, tmp_path, capsys):
    from lit_transformer.model.interop.directories import read_safetensors
    from lit_transformer.training.averaging import average_state_dicts, last_checkpoints
    from lit_transformer.training.checkpoints import read_checkpoint

    run = tiny_runs["tiny-seq2seq"]
    paths = last_checkpoints(run, 2)
    assert [p.name for p in paths] == ["step-4.ckpt", "step-6.ckpt"]
    a, b = (read_checkpoint(p)["state_dict"] for p in paths)
    mean = average_state_dicts(paths)
    for name in a:
        assert torch.equal(mean[name], ((a[name].float() + b[name].float()) / 2).to(a[name].dtype)), name
    assert main(["average", str(run), str(tmp_path / "one"), "--last", "1"]) == 0
    weights = read_safetensors(tmp_path / "one" / "model.safetensors")
    for name, value in weights.items():
        assert torch.equal(value, b[f"model.{name}"]), name
    assert main(["average", str(run), str(tmp_path / "two"), "--last", "2"]) == 0
    for name, value in read_safetensors(tmp_path / "two" / "model.safetensors").items():
        assert torch.equal(value, mean[f"model.{name}"]), name
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "two"), "--prompt", "Return the name.", "--greedy"]) == 0
    assert main(["average", str(run), str(tmp_path / "x"), "--last", "7"]) == 2
    assert "--last 7 but the run keeps 3 checkpoint(s)" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("beams", ["1", "3"])
def test_evaluate_bleu_equals_sacrebleu_on_generate_output(beams, tiny_runs, tmp_path, capsys):
    from sacrebleu.metrics import BLEU, CHRF

    from lit_transformer.data.sources.stdlib import seq2seq_examples

    pairs = seq2seq_examples()["test"][:13]
    (tmp_path / "src.txt").write_text("".join(p["source"] + "\n" for p in pairs))
    (tmp_path / "ref.txt").write_text("".join(p["target"] + "\n" for p in pairs))
    run = str(tiny_runs["tiny-seq2seq"])
    options = ["--num-beams", beams, "--length-penalty", "0.6", "--max-new-tokens", "7", "--batch-size", "4"]
    assert (
        main(
            [
                "evaluate",
                run,
                "--data",
                str(tmp_path / "src.txt"),
                "--data-target",
                str(tmp_path / "ref.txt"),
                "--json",
                *options,
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"eval/data/loss", "eval/data/accuracy"}  # the pairs' loss, as heldout computes it
    prefix = "eval/data_translation/"
    metrics = {key.removeprefix(prefix): value for key, value in out.items() if key.startswith(prefix)}
    assert metrics["sentences_per_s"] > 0 and metrics["tokens_per_s"] > 0
    assert metrics["dtype"] in ("bfloat16", "float32") and metrics["device"] == "cpu"
    assert (
        main(
            [
                "generate",
                run,
                "--input",
                str(tmp_path / "src.txt"),
                "--output",
                str(tmp_path / "hyp.txt"),
                "--greedy",
                *options,
            ]
        )
        == 0
    )
    hypotheses = (tmp_path / "hyp.txt").read_text().splitlines()
    references = [p["target"] for p in pairs]
    assert metrics["sentences"] == 13
    assert metrics["bleu"] == pytest.approx(BLEU().corpus_score(hypotheses, [references]).score, abs=1e-9)
    assert metrics["chrf"] == pytest.approx(CHRF().corpus_score(hypotheses, [references]).score, abs=1e-9)
    assert metrics["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
