"""benchmarks/generation.py's logic without timing anything: the bytes a decoding step reads,
the ratio of the tokens/s it prints beside the range of alternating rounds, the --quick
expansion, and one tiny end-to-end run against transformers on the same weights."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import each other as top-level modules
import common  # noqa: E402
import generation  # noqa: E402

from lit_transformer.model import LanguageModel, preset  # noqa: E402


def test_bytes_per_step_of_a_decoder_count_weights_once_and_the_mean_cache_length():
    cfg = preset(
        "gpt2-small",
        vocab_size=10,
        d_model=4,
        n_heads=2,
        n_layers=1,
        d_ff=8,
        max_seq_len=16,
        bias=False,
        norm="rmsnorm",
    )
    model = LanguageModel.from_config(cfg)
    read = generation.step_bytes(model, batch=3, beams=2, prompt_length=5, new_tokens=4)
    # tokens 10x4 (tied: the LM head reads it) + q,k,v,o 4x(4x4) + up 8x4 + down 4x8 + three norms of 4;
    # the 16x4 position table is not read whole. float32: 4 bytes.
    assert read["weights"] == (40 + 64 + 32 + 32 + 12) * 4
    # per cached position and row: 1 layer x (K, V) x 2 heads x 2 dims x 4 bytes = 32; 3 prompts x 2 beams;
    # step j of 4 attends over 5 + j keys: mean 6.5
    assert read["kv_cache"] == pytest.approx(6 * 32 * 6.5)
    assert read["total"] == pytest.approx(read["weights"] + read["kv_cache"])


def test_bytes_per_step_of_t5_leave_out_the_encoder_and_read_the_cross_attention_cache():
    cfg = preset("t5-base", vocab_size=10, d_model=4, n_heads=2, head_dim=3, n_layers=1, d_ff=8)
    model = LanguageModel.from_config(cfg).to(torch.bfloat16)
    read = generation.step_bytes(model, batch=2, beams=1, prompt_length=7, new_tokens=5)
    # decoder only: tokens 40 + relative bias 32x2 + self q,k,v 3x(6x4) + o 4x6 + cross the same 96
    # + up 32 + down 32 + four norms of 4; bfloat16: 2 bytes
    assert read["weights"] == (40 + 64 + 96 + 96 + 64 + 16) * 2
    # per position and row: (K, V) x 2 heads x 3 dims x 2 bytes = 24; own keys 1 + (5-1)/2 = 3, plus 7 encoder positions
    assert read["kv_cache"] == pytest.approx(2 * 24 * (3 + 7))


def test_quick_fills_only_the_flags_not_given():
    quick = generation.parse_args(["--quick", "--device", "cpu"])
    assert (quick.shapes, quick.batches, quick.modes, quick.dtypes) == (["gpt2"], [1, 8], ["greedy"], ["float32"])
    assert (quick.new_tokens, quick.rounds) == (32, 5)
    mixed = generation.parse_args(["--quick", "--dtypes", "bfloat16", "--rounds", "5", "--device", "cpu"])
    assert (mixed.dtypes, mixed.rounds, mixed.shapes) == (["bfloat16"], 5, ["gpt2"])
    full = generation.parse_args(["--device", "cpu"])
    assert (full.shapes, full.batches, full.modes) == (["gpt2", "t5"], [1, 8, 32], ["greedy", "beam4"])
    assert (full.dtypes, full.new_tokens, full.rounds) == (["float32", "bfloat16"], 128, 5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shapes", "gpt2,llama"], "--shapes: unknown value 'llama'"),
        (["--batches", "1,x"], "--batches: 'x' is not a int"),
        (["--batches", "0"], "--batches: '0' must be at least 1"),
        (["--new-tokens", "0"], "--new-tokens: 0 must be at least 1"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag_and_value(argv, message, capsys):
    with pytest.raises(SystemExit):
        generation.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_cell_reports_the_ratio_of_its_own_tokens_per_s_and_the_rounds_range(monkeypatch):
    """run_cell with the decoders and the clock replaced: tokens/s uses each side's median run,
    the ratio is exactly ours tokens/s / transformers' (what the table prints, so a row can be
    checked from its columns), and the range is that of the per-round ratios."""
    clock = iter([1.0, 1.5, 2.0, 2.0, 1.0, 0.9])  # ours, theirs, ours, theirs, ...
    tokens = torch.tensor([[7, 8, 9]])

    def fake_decoders(shape, ours, theirs, prompt, beams, cuda_graph=True):
        return (lambda n: tokens), (lambda n: tokens.clone())

    monkeypatch.setattr(generation, "decoders", fake_decoders)
    monkeypatch.setattr(generation, "timed", lambda fn, n, device: (next(clock), fn(n)))
    cfg = preset("gpt2-small", vocab_size=10, d_model=4, n_heads=2, n_layers=1, d_ff=8, max_seq_len=16)
    model = LanguageModel.from_config(cfg)
    args = generation.parse_args(["--device", "cpu", "--new-tokens", "3", "--rounds", "3", "--prompt-length", "2"])
    cell = generation.run_cell(args, "gpt2", (model, None), 1, "greedy", "float32", bandwidth=1e9)
    assert cell["tokens_per_s"] == pytest.approx(3 / 1.0) and cell["transformers_tokens_per_s"] == pytest.approx(
        3 / 1.5
    )
    # rounds' ratios 1.5, 1.0, 0.9 (their median would say 1.0x beside tokens/s that say 1.5x)
    assert cell["ratio"] == pytest.approx(1.5) == cell["tokens_per_s"] / cell["transformers_tokens_per_s"]
    assert cell["ratio_range"] == pytest.approx([0.9, 1.5])
    assert cell["identical_tokens"] and cell["token_agreement"] == 1.0
    step = generation.step_bytes(model, batch=1, beams=1, prompt_length=2, new_tokens=3)["total"]
    assert cell["bandwidth_utilisation"] == pytest.approx(step * 3 / 1.0 / 1e9)


def test_agreement_is_the_fraction_of_equal_tokens_and_shapes_must_match():
    assert generation.agreement(torch.tensor([[1, 2], [3, 4]]), torch.tensor([[1, 2], [3, 5]])) == 0.75
    with pytest.raises(common.ComparisonError, match=r"ours wrote \(1, 2\) tokens, transformers \(1, 3\)"):
        generation.agreement(torch.zeros(1, 2), torch.zeros(1, 3))


def test_a_tiny_end_to_end_run_matches_transformers_token_for_token(monkeypatch, tmp_path, capsys):
    """Both shapes at toy sizes through transformers' generate: float32 greedy and beam search
    write the same tokens as ours, and the JSON has the documented keys."""
    tiny = {"vocab_size": 64, "d_model": 16, "n_heads": 2, "d_ff": 32, "dropout": 0.0, "n_layers": 1}

    def make_config(shape, layers, max_len):
        if shape == "gpt2":
            return preset("gpt2-small", max_seq_len=64, attention_dropout=0.0, **tiny)
        return preset("t5-base", head_dim=8, **tiny)

    monkeypatch.setattr(generation, "make_config", make_config)
    monkeypatch.setattr(common, "memory_bandwidth", lambda device: [1e10, 2e10])
    out = tmp_path / "gen.json"
    argv = ["--device", "cpu", "--batches", "2", "--new-tokens", "3", "--rounds", "1", "--prompt-length", "4"]
    table = io.StringIO()
    with contextlib.redirect_stdout(table):  # as run.py --json calls it: its stdout is one JSON object
        report = generation.main(argv + ["--modes", "greedy,beam4", "--dtypes", "float32", "--json", str(out)])
    assert capsys.readouterr().out == "" and "ratio" in table.getvalue()
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["memory_bandwidth_bytes_per_s"] == 2e10 and set(report["models"]) == {"gpt2", "t5"}
    assert [(c["shape"], c["mode"]) for c in report["results"]] == [
        ("gpt2", "greedy"),
        ("gpt2", "beam4"),
        ("t5", "greedy"),
        ("t5", "beam4"),
    ]
    for cell in report["results"]:
        assert cell["identical_tokens"], cell
        assert {"tokens_per_s", "transformers_tokens_per_s", "ratio", "ratio_range", "bytes_per_step"} <= set(cell)
        assert len(cell["seconds"]) == len(cell["transformers_seconds"]) == 1
        if torch.backends.mkldnn.is_available():  # the path generate measured at the warm-up
            assert cell["ours_linears"] in ("packed", "plain") and len(cell["linears_measured_s"]) == 2


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_forced_linears_hold_ours_to_one_path_and_are_undone():
    from lit_transformer.model.packed_linear import packed_linears

    cfg = preset("gpt2-small", vocab_size=10, d_model=4, n_heads=2, n_layers=1, d_ff=8, max_seq_len=16)
    model = LanguageModel.from_config(cfg)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]

    def run_ours(n):  # what generate's own packed_linears block would pack inside the run
        with packed_linears(model, rows=3, when="always") as count:
            return count, {type(m.__dict__.get("forward")).__name__ for m in linears}

    assert generation.forced_linears(run_ours, model, 3, "plain")(1) == (0, {"method"})
    assert generation.forced_linears(run_ours, model, 3, "packed")(1) == (0, {"_PackedForward"})
    assert run_ours(1) == (len(linears), {"_PackedForward"})  # nothing left behind by either
    assert not any("forward" in m.__dict__ for m in linears)
