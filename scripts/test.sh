#!/usr/bin/env bash
# Install, then run the whole test suite (the README's test command; .ci/run calls this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
exec python3 -m pytest -q "$@"
