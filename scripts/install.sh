#!/usr/bin/env bash
# Install lit-transformer (editable) with its dev and store extras (dev holds the test tools, moto's
# S3 server among them: tests/data/test_data_shared_store.py). On a machine without a CUDA
# GPU, torch 2.13.0 (CPU build) goes in first: a bare `torch` requirement would pull several GB
# of CUDA packages. Set LIT_TRANSFORMER_TORCH to choose another torch spec, and
# LIT_TRANSFORMER_EXTRAS to choose the extras (comma-separated).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${LIT_TRANSFORMER_EXTRAS:-dev,store}"
python3 -m pip install -q "${LIT_TRANSFORMER_TORCH:-torch==2.13.0}"
python3 -m pip install -q -e ".[${EXTRAS}]"
case ",${EXTRAS}," in
  *,store,*)
    # data.store=litdata: litdata without its declared dependencies (the store extra holds the
    # ones it uses). Its metadata requires torchvision, which it imports only for images and
    # video, and whose wheels pin a torch of their own: pip would replace the CPU torch above
    # with a CUDA build. The version is the one tests/data/test_data_store.py was run with. A plain
    # `pip install -e ".[dev,store]"` skips this step: tests/test_skips.py then fails, naming it.
    python3 -m pip install -q --no-deps "litdata==0.2.76"
    ;;
esac
