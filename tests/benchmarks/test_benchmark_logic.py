"""benchmarks/run.py's comparison logic, without timing anything: the headline ratio against
transformers is the median of alternating rounds with their range, and a family whose two sides
disagree on the first loss fails the comparison instead of reporting a speed; the precision
and the matmul probe follow the machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import each other as top-level modules
import common  # noqa: E402
import run  # noqa: E402


def test_the_speedup_is_the_median_of_paired_rounds_with_their_range():
    ours = [1.0, 1.0, 2.0, 1.0, 1.0]  # round 3: ours hit by background load
    theirs = [1.5, 1.6, 2.0, 1.4, 0.9]  # round 5: transformers' luckiest step
    summary = common.paired_speedup(ours, theirs)
    assert summary == {"median": pytest.approx(1.4), "min": pytest.approx(0.9), "max": pytest.approx(1.6)}
    # not one side's fastest step against the other's: that would claim 0.9 / 1.0 or 1.4 / 1.0
    assert summary["median"] != pytest.approx(min(theirs) / min(ours))
    assert run.speedup_text({"speedup_vs_transformers": 1.4, "speedup_range": [0.9, 1.6]}) == "1.40x (0.90-1.60)"


def test_unpaired_rounds_are_refused():
    with pytest.raises(ValueError, match="3 against 2"):
        common.paired_speedup([1.0, 1.0, 1.0], [1.0, 1.0])


def test_first_losses_that_agree_pass_and_ones_that_differ_fail():
    common.check_first_losses("gpt2_clm", 10.81, 10.82)
    with pytest.raises(
        common.ComparisonError, match=r"t5_span: first losses differ \(ours 9\.0000, transformers 10\.5000"
    ):
        common.check_first_losses("t5_span", 9.0, 10.5)
    with pytest.raises(common.ComparisonError, match="bert_mlm"):
        common.check_first_losses("bert_mlm", float("nan"), 10.5)


def test_a_failed_comparison_exits_non_zero_naming_the_family(monkeypatch, capsys):
    """run.py's command: a family whose first losses differ stops the run with exit status 1
    and a message naming the family and both losses; nothing is reported on stdout. (The
    family's models and the matmul probe are replaced: nothing is built or timed.)"""

    class NoPeak:
        best, rates, dtype = 1.0, [], torch.float32

        def __call__(self):
            pass

    monkeypatch.setattr(run, "make_peak", lambda args: NoPeak())
    monkeypatch.setattr(run, "run_family", lambda args, family, peak: common.check_first_losses(family, 3.0, 4.0))
    assert run.cli(["--families", "gpt2_clm", "--no-generation", "--no-data-prep"]) == 1
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: gpt2_clm: first losses differ (ours 3.0000, transformers 4.0000"), last
    assert out == ""


@pytest.mark.parametrize(
    ("flags", "device", "precision", "why"),
    [
        (set(), "cpu", "32-true", "32-true: this CPU has no bf16 matrix instructions"),
        ({"avx2", "avx512_bf16"}, "cpu", "bf16-mixed", "bf16-mixed: this CPU has bf16 matrix instructions"),
        ({"amx_bf16"}, "cpu", "bf16-mixed", "bf16-mixed: this CPU has bf16 matrix instructions"),
        (set(), "cuda", "bf16-mixed", "bf16-mixed: a CUDA device"),
    ],
)
def test_the_precision_follows_the_machine(monkeypatch, flags, device, precision, why):
    from lit_transformer import machine

    monkeypatch.setattr(machine, "cpu_flags", lambda: flags)
    chosen, reason = common.choose_precision(device, None)
    assert chosen == precision and reason.startswith(why)
    assert common.choose_precision(device, "bf16-true") == ("bf16-true", "bf16-true: given by --precision")


def test_onednn_capped_below_bf16_counts_as_no_bf16(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN off AVX512-BF16: bf16 is then emulated, whatever the
    CPU's flags say (how an AVX2-only machine is simulated on a newer one)."""
    from lit_transformer import machine

    monkeypatch.setattr(machine, "cpu_flags", lambda: {"avx512_bf16", "avx2"})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not machine.cpu_has_bf16_matmul() and common.choose_precision("cpu", None)[0] == "32-true"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert machine.cpu_has_bf16_matmul()


def test_quick_on_a_cpu_without_bf16_probes_a_small_float32_product(monkeypatch):
    """The matmul peak is measured in the dtype the steps' products run in, at a size that
    takes seconds in --quick (the AVX2-only CPU spent minutes on an emulated 4096^3 bf16 product)."""
    from lit_transformer import machine

    monkeypatch.setattr(machine, "cpu_flags", lambda: {"avx2", "fma"})
    built = {}
    monkeypatch.setattr(
        common,
        "MatmulPeak",
        lambda device, size, inner, dtype: built.update(device=device, size=size, inner=inner, dtype=dtype),
    )
    args = run.parse_args(["--quick"])
    assert (args.precision, args.mode, args.rounds) == ("32-true", "quick", 5)
    # the memory subprocesses (fresh imports of torch, Lightning, transformers) only when asked for
    assert args.no_memory and not run.parse_args(["--quick", "--memory"]).no_memory and not run.parse_args([]).no_memory
    run.make_peak(args)
    assert built == {"device": "cpu", "size": 2048, "inner": 2, "dtype": torch.float32}
    monkeypatch.setattr(machine, "cpu_flags", lambda: {"avx512_bf16"})
    run.make_peak(run.parse_args([]))
    assert (built["size"], built["dtype"]) == (4096, torch.bfloat16)
    run.make_peak(run.parse_args(["--quick", "--precision", "32-true"]))
    assert built["dtype"] == torch.float32


def test_the_table_states_the_precision_and_the_generation_cells(capsys):
    cell = {
        "shape": "gpt2",
        "batch": 8,
        "mode": "greedy",
        "dtype": "float32",
        "tokens_per_s": 120.0,
        "transformers_tokens_per_s": 100.0,
        "ratio": 1.2,
        "ratio_range": [1.1, 1.3],
        "identical_tokens": False,
        "token_agreement": 0.975,
        "bandwidth_utilisation": 0.25,
    }
    report = {
        "device": "cpu: test",
        "precision_reason": "32-true: this CPU has no bf16 matrix instructions",
        "matmul_peak_dtype": "float32",
        "matmul_peak_flops": 1e11,
        "results": [],
        "generation": {"new_tokens": 32, "results": [cell]},
        "data_prep": None,
    }
    run.print_table(report, sys.stdout)
    out = capsys.readouterr().out
    assert "precision 32-true: this CPU has no bf16 matrix instructions; float32 matmul peak measured: 100.0" in out
    assert (
        "generation gpt2 B=8 greedy float32 (32 new tokens): ours 120.0 tok/s, transformers 100.0 tok/s, "
        "1.20x (1.10-1.30), 97.5% same tokens, 25.0% of memory bandwidth"
    ) in out


def test_recipe_sweep_corpora_resolve_to_data_overrides(tmp_path):
    import recipe_sweep

    (tmp_path / "a.txt").write_text("train\n")
    (tmp_path / "b.txt").write_text("val\n")
    assert recipe_sweep.corpus_overrides("stdlib", tmp_path) == ["data.train_files=[]", "data.val_files=[]"]
    own = recipe_sweep.corpus_overrides(f"mine={tmp_path / 'a.txt'}:{tmp_path / 'b.txt'}", tmp_path)
    assert own == [f"data.train_files=[{tmp_path / 'a.txt'}]", f"data.val_files=[{tmp_path / 'b.txt'}]"]
    with pytest.raises(SystemExit, match="unknown corpus 'novels'"):
        recipe_sweep.corpus_overrides("novels", tmp_path)
    with pytest.raises(SystemExit, match="no such file"):
        recipe_sweep.corpus_overrides("wikitext2", tmp_path)  # tmp_path holds no wikitext2/
    with pytest.raises(SystemExit):
        recipe_sweep.parse_args(["--corpora", "stdlib", "--held-out", "wikitext2"])


def test_recipe_sweep_gives_nanogpt_the_corpus_files_and_writes_the_embedded_splits(tmp_path):
    import recipe_sweep

    (tmp_path / "a.txt").write_text("train\n")
    (tmp_path / "b.txt").write_text("val\n")
    own = recipe_sweep.corpus_files(f"mine={tmp_path / 'a.txt'}:{tmp_path / 'b.txt'}", tmp_path, tmp_path / "out")
    assert own == (tmp_path / "a.txt", tmp_path / "b.txt")
    train, val = recipe_sweep.corpus_files("stdlib", tmp_path, tmp_path / "out")
    from lit_transformer.data.sources.stdlib import corpus_split

    first_val = corpus_split("validation")[0][1].read_text("utf-8", "replace")
    assert val.read_text("utf-8").startswith(first_val) and train.stat().st_size > 10 * val.stat().st_size


def _write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def test_classify_sweep_builds_trec_and_genre_tasks_with_disjoint_balanced_splits(tmp_path, monkeypatch):
    import classify_sweep

    data = tmp_path / "data"
    trec = [f"{'HUM:ind' if i % 2 else 'LOC:city'} Question number {i} ?" for i in range(600)]
    _write_lines(data / "trec" / "train_5500.label", trec)
    _write_lines(data / "trec" / "TREC_10.label", trec[:10])
    coarse = classify_sweep.trec_rows(data / "trec", fine=False)
    fine = classify_sweep.trec_rows(data / "trec", fine=True)
    assert {label for _, label in coarse["train"]} == {"HUM", "LOC"}
    assert {label for _, label in fine["train"]} == {"HUM:ind", "LOC:city"}
    assert (len(coarse["train"]), len(coarse["valid"]), len(coarse["test"])) == (100, 500, 10)

    words = " ".join(f"w{i}" for i in range(8))
    shared = [f"Also in the test file {i} {words}." for i in range(20)]  # must only ever test
    for split in ("train", "valid", "test"):
        tatoeba = [f"Tatoeba {split} {i} {words}." for i in range(16 if split == "train" else 30)]
        _write_lines(data / "tatoeba_de_en" / f"{split}.en", tatoeba + (shared if split != "valid" else []))
        _write_lines(data / "wmt_news_de_en" / f"{split}.en", [f"News {split} {i} {words}." for i in range(30)])
    wiki = [" = Heading = "] + [
        f"In {split} the state @-@ of @-@ the @-@ art cost 1 @,@ {i:03d} dollars , said {'he' if i % 3 else '<unk>'} . "
        f"Wiki {split} {i} {words} ."
        for split in ("train", "test")
        for i in range(40)
    ]
    _write_lines(data / "wikitext2" / "test.txt", wiki[:41])
    _write_lines(data / "wikitext2" / "valid.txt", [wiki[0]] + wiki[41:])
    monkeypatch.setattr(classify_sweep, "GENRE_SENTENCES", {"train": 12, "valid": 4, "test": 5})
    rows = classify_sweep.genre_rows(data)
    for split, count in (("train", 12), ("valid", 4), ("test", 5)):
        labels = [label for _, label in rows[split]]
        assert {label: labels.count(label) for label in labels} == {"tatoeba": count, "news": count, "wikipedia": count}
    texts = {split: {text for text, _ in split_rows} for split, split_rows in rows.items()}
    assert not (texts["train"] & texts["valid"] or texts["train"] & texts["test"] or texts["valid"] & texts["test"])
    wiki_texts = [text for split_rows in rows.values() for text, label in split_rows if label == "wikipedia"]
    assert all("@" not in text and " ," not in text and "<unk>" not in text and "=" not in text for text in wiki_texts)
    assert any(
        text.startswith("In train the state-of-the-art cost 1,0") and text.endswith("said he.") for text in wiki_texts
    )
    assert all(" test " in f" {text} " for text, _ in rows["test"])  # test sentences come from the test files
    assert all(" train " in f" {text} " for split in ("train", "valid") for text, _ in rows[split])

    with pytest.raises(SystemExit, match="no such file"):
        classify_sweep.genre_rows(tmp_path / "nowhere")
    monkeypatch.setattr(classify_sweep, "GENRE_SENTENCES", {"train": 100, "valid": 4, "test": 5})
    with pytest.raises(SystemExit, match="too few tatoeba sentences"):
        classify_sweep.genre_rows(data)
