"""benchmarks/gpu_check.py, the one command a lent GPU runs: without CUDA it says so and exits 0;
on this CPU (--device cpu --quick) every check passes or is skipped, one JSON row per check; a
check that raises is a `fail` row, the others still run, and the exit status is 1."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_script().main([]) == 0
    assert capsys.readouterr().out.strip() == load_script().NO_CUDA


@pytest.mark.slow
def test_every_check_passes_or_skips_on_this_cpu(tmp_path, capsys):
    """In this process (a second one would spend seconds importing what this one has); the
    environment is restored afterwards (the strategies check starts and ends a process group)."""
    out = tmp_path / "rows.json"
    environment = dict(os.environ)
    try:
        status = load_script().main(["--device", "cpu", "--quick", "--json", str(out)])
    finally:
        os.environ.clear()
        os.environ.update(environment)
    stdout, stderr = capsys.readouterr()
    report = json.loads(out.read_text())
    rows = report["rows"]
    FAMILIES = load_script().FAMILIES
    assert [row["check"] for row in rows] == list(load_script().CHECKS)
    failed = {row["check"]: row["detail"] for row in rows if row["status"] == "fail"}
    assert not failed and status == 0, (failed, stderr[-3000:])
    assert {row["status"] for row in rows} <= {"pass", "skip"}
    by_name = {row["check"]: row for row in rows}
    assert by_name["peak_memory"]["status"] == "skip"  # CUDA's allocator statistics only
    # the rows carry their numbers: each family learned (the first loss against the mean of the
    # last two), on a CPU in one precision each, alternating from bf16-mixed
    losses = by_name["families"]["losses"]
    expected = [f"{r.removeprefix('tiny-')}/{('bf16-mixed', 'bf16-true')[i % 2]}" for i, r in enumerate(FAMILIES)]
    assert list(losses) == expected and all(last < first for first, last in losses.values()), losses
    assert by_name["activation_checkpointing"]["max_relative_difference"] <= 2e-3
    assert 0 < by_name["mfu"]["mfu_measured_peak"]
    for row in rows:  # the table printed every check with its status
        assert f"{row['check']:<25} {row['status']:<6}" in stdout


def test_a_check_that_raises_is_a_fail_row_and_the_others_still_run(tmp_path, monkeypatch):
    script = load_script()

    def broken(ctx):
        raise RuntimeError("fused kernel exploded\nsecond line of the message")

    monkeypatch.setattr(script, "check_fused_adamw", broken)
    out = tmp_path / "rows.json"
    status = script.main(["--device", "cpu", "--quick", "--checks", "fused_adamw,peak_memory", "--json", str(out)])
    assert status == 1
    rows = json.loads(out.read_text())["rows"]
    assert [(r["check"], r["status"]) for r in rows] == [("fused_adamw", "fail"), ("peak_memory", "skip")]
    assert rows[0]["detail"] == "RuntimeError: fused kernel exploded"
    assert rows[0]["seconds"] >= 0


def test_a_check_that_finds_wrong_numbers_fails_with_its_reason(tmp_path):
    """CheckFailed, a check's own verdict: recorded with its message, no traceback needed."""
    script = load_script()
    ctx = script.Context("cpu", True, tmp_path)
    script.check_demo = lambda ctx: script.need(1 + 1 == 3, "arithmetic is off")
    row = script.run_check("demo", ctx)
    assert (row["status"], row["detail"]) == ("fail", "CheckFailed: arithmetic is off")
    script.check_demo = lambda ctx: {"detail": "fine", "value": 3}
    assert {k: v for k, v in script.run_check("demo", ctx).items() if k != "seconds"} == {
        "check": "demo",
        "status": "pass",
        "detail": "fine",
        "value": 3,
    }


def test_unknown_checks_are_refused():
    with pytest.raises(SystemExit):
        load_script().parse_args(["--checks", "families,flex"])
