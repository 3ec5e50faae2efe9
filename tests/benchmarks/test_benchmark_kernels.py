"""benchmarks/kernels.py's rule without timing anything: each case is the median of its timed
runs after an untimed warm-up (not the best run), and bad flags are refused naming the value."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import each other as top-level modules
import kernels  # noqa: E402


def test_a_case_is_the_median_of_its_runs_after_the_warm_up(monkeypatch):
    # perf_counter pairs (start, end): 1 ms, 5 ms, 2 ms, 9 ms, 3 ms; the warm-up call is not timed
    stamps = iter([0.0, 0.001, 1.0, 1.005, 2.0, 2.002, 3.0, 3.009, 4.0, 4.003])
    monkeypatch.setattr(kernels.time, "perf_counter", lambda: next(stamps))
    calls = []
    assert kernels.median_ms(lambda: calls.append(1), repeat=5) == pytest.approx(3.0)
    assert len(calls) == 6  # warm-up + 5 timed
    assert next(stamps, None) is None


@pytest.mark.parametrize("argv", [["--repeat", "0"], ["--threads", "0"]])
def test_bad_counts_are_refused_naming_the_value(argv, capsys):
    with pytest.raises(SystemExit):
        kernels.main(argv)
    assert f"{argv[0]} 0" in capsys.readouterr().err
