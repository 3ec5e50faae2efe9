#!/usr/bin/env bash
# Install lit-transformer (editable) with its dev and store extras (dev holds the test tools, moto's
# S3 server among them: tests/data/test_data_shared_store.py). On a machine without a CUDA
# GPU, torch 2.13.0 (CPU build) goes in first: a bare `torch` requirement would pull several GB
# of CUDA packages. Set LIT_TRANSFORMER_TORCH to choose another torch spec, and
# LIT_TRANSFORMER_EXTRAS to choose the extras (comma-separated).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${LIT_TRANSFORMER_EXTRAS:-dev,store}"
TORCH="${LIT_TRANSFORMER_TORCH:-torch==2.13.0}"
# pip spends seconds deciding that an installed pin is installed: ask the metadata first
python3 - "$TORCH" <<'PY' || python3 -m pip install -q "$TORCH"
import importlib.metadata, sys
name, _, version = sys.argv[1].partition("==")
sys.exit(0 if version and importlib.metadata.version(name).split("+")[0] == version else 1)
PY
# An isolated build environment costs about 8 s of every install (a fresh clone's CI included);
# the one already here serves when it holds the setuptools that pyproject.toml asks for.
ISOLATION=()
if python3 -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)" 2>/dev/null; then
  ISOLATION=(--no-build-isolation)
fi
python3 -m pip install -q "${ISOLATION[@]}" -e ".[${EXTRAS}]"
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
