"""A pytest plugin that records the figures behind the suite's quality bars, for margins.

    PYTHONPATH=tests python -m pytest -p quality_figures -o enable_assertion_pass_hook=true \
        -m "not distributed" [--quality-figures FILE] [--assume-bf16-cpu] [test files]

Every assertion that passes and compares a quality figure (an accuracy, a loss, bits per byte,
BLEU, a relative error: QUALITY below) with a bound is appended to FILE (quality-figures.jsonl)
as one JSON line: the test, the line, the assertion and pytest's explanation, which holds the
values. Run it on each kernel path (docs/guarantees.md, "CPU kinds") and compare the files: the
worst value per assertion against its bar is that bar's margin. --assume-bf16-cpu makes the
program believe the CPU has AVX512-BF16, so that recipes default to bf16 as they do on such a
CPU (the products are then emulated here: slower, and other numbers).
Set PYTHONDONTWRITEBYTECODE=1 (or remove tests/__pycache__ first): test modules that pytest
rewrote and cached before the hook was enabled do not call it. Not a test file: pytest loads it
only when named with -p.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.register_assert_rewrite("helpers", "option_pairs")  # their bars too, not only test files'
QUALITY = re.compile(r"accuracy|\bacc|bleu|bpb|bits_per_byte|perplexity|loss|f1|error|moved", re.IGNORECASE)


def pytest_addoption(parser):
    group = parser.getgroup("quality figures")
    group.addoption("--quality-figures", default="quality-figures.jsonl", help="where to append the figures")
    group.addoption("--assume-bf16-cpu", action="store_true", help="recipes default to bf16 as on AVX512-BF16")


def pytest_configure(config):
    if config.getoption("--assume-bf16-cpu"):
        from lit_transformer import machine

        machine.cpu_flags = lambda: {"avx2", "avx512f", "avx512_bf16"}  # before any recipe is read


def pytest_assertion_pass(item, lineno, orig, expl):
    if QUALITY.search(orig) and re.search(r"[<>]", orig):
        record = {"test": item.nodeid, "line": lineno, "assert": orig, "values": expl}
        with open(item.config.getoption("--quality-figures"), "a") as file:
            file.write(json.dumps(record) + "\n")
