#!/usr/bin/env bash
# Install, then run the whole test suite (the README's test command; .ci/run calls this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
# Two worker processes (pytest-xdist), a test file each at a time, so that the tests of one file
# share their module's runs: one process alone kept about one core of the two busy. Files go
# out in collection order, longest first (tests/conftest.py), not xdist's most-tests-first.
exec python3 -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
