"""benchmarks/run.py's comparison logic, without timing anything: the headline ratio against
transformers is the median of alternating rounds with their range, and a family whose two sides
disagree on the first loss fails the comparison instead of reporting a speed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
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
        best, rates = 1.0, []

        def __call__(self):
            pass

    monkeypatch.setattr(run, "make_peak", lambda args: NoPeak())
    monkeypatch.setattr(run, "run_family", lambda args, family, peak: common.check_first_losses(family, 3.0, 4.0))
    assert run.cli(["--families", "gpt2_clm", "--no-generation", "--no-data-prep"]) == 1
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: gpt2_clm: first losses differ (ours 3.0000, transformers 4.0000"), last
    assert out == ""
