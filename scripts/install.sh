#!/usr/bin/env bash
# Install lit-transformer (editable) with its dev extra. On a machine without a CUDA GPU,
# torch 2.13.0 (CPU build) goes in first: a bare `torch` requirement would pull several GB
# of CUDA packages. Set LIT_TRANSFORMER_TORCH to choose another torch spec.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "${LIT_TRANSFORMER_TORCH:-torch==2.13.0}"
python3 -m pip install -q -e ".[${LIT_TRANSFORMER_EXTRAS:-dev}]"
