#!/usr/bin/env bash
# Set up a real SGLang (upstream 0.5.23 on CPU torch) and the tiny local model for tether's
# integration tests (tests/real_sglang).
#
# SGLang's server, tokenizer manager, scheduler, detokenizer and abort code run unmodified.
# What it takes on CPU (shared/ENGINES.md §12):
# - sglang itself without its declared dependencies, then those it imports minus the CUDA,
#   GPU-kernel and media ones, plus `dill` and `jsonschema` (imported, not declared);
# - torch 2.13.0+cpu (sglang pins 2.14.1, whose PyPI build is CUDA and pulls ~3 GB of
#   nvidia wheels; pip only warns), triton (imported at module level), torchvision without
#   its dependencies, patched so that its CUDA build imports beside CPU torch;
# - a pure-torch `sgl_kernel` stub: with SGLANG_USE_CPU_ENGINE=1 sglang imports a few CPU
#   ops from it at module level, and no package on the index ships them.
# Nothing is downloaded from a model hub: the model (tiny_model.sh) is a tiny Llama config
# served with `--load-format dummy`, its tokenizer trained here on local text.
#
# Idempotent: a stamp file makes a second run take well under a second.
# Output: the last line on stdout is machine-readable,
#   SGLANG_PYTHON=<venv python> SGLANG_MODEL=<model dir> SGLANG_VERSION=<version>
# and the same assignments are written to "$CACHE/sglang-cpu.env" (sourceable by bash).
#
# Env: TETHER_ENGINE_CACHE (default ~/.cache/tether/engines), PYTHON (default python3.11 or python3).
set -euo pipefail

readonly SGLANG_VERSION="0.5.23"
readonly TORCH_VERSION="2.13.0+cpu"
readonly TORCHVISION_VERSION="0.28.0"
readonly TRITON_VERSION="3.8.0"
readonly CACHE="${TETHER_ENGINE_CACHE:-$HOME/.cache/tether/engines}"
readonly VENV="$CACHE/sglang-cpu-$SGLANG_VERSION"
readonly MODEL="$CACHE/tiny-llama"
readonly ENV_FILE="$CACHE/sglang-cpu.env"
# Bump when the venv recipe below changes, so existing caches are rebuilt (the model has its
# own recipe number in tiny_model.sh).
readonly RECIPE="1"
readonly VENV_STAMP="$VENV/.tether-ready-$RECIPE"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly HERE

# sglang 0.5.23's declared requirements that the CPU server imports, with sglang's own pins.
# Left out: torch/torchvision/triton (installed apart, below) and everything for CUDA, GPU
# kernels or media: torchaudio, torchcodec, cuda-python, flash-attn-4, flashinfer-python,
# sglang-kernel, sgl-deep-ep, sgl-deep-gemm, sgl-flash-mla, tilelang, torch-memory-saver,
# nvidia-*, nvshmem4py, quack-kernels, humming-kernels, timm, kernels, av, decord2,
# datasets, modelscope, outlines, numba, smg-grpc-servicer, mistral-common, py-spy,
# deepseek-recipe, tml-renderers. soundfile stays: the HTTP server imports it at start.
readonly REQUIREMENTS=(
  aiohttp "anthropic>=0.20.0" apache-tvm-ffi==0.1.11 blobfile==3.0.0 build
  compressed-tensors==0.18.0 distro easydict einops fastapi gguf interegular IPython
  "llguidance>=1.7.6,<2.0.0" msgspec ninja numpy openai==2.8.0 openai-harmony==0.0.4 orjson
  packaging partial_json_parser pillow "prometheus-client>=0.20.0" psutil pybase64 pydantic
  "python-dateutil<3" python-multipart "pyzmq>=25.1.2" regex requests scipy
  sentencepiece==0.2.1 setproctitle soundfile==0.13.1 tiktoken tokenizers==0.23.2 tqdm
  transformers==5.19.0 "uvicorn>=0.51" uvloop watchfiles xgrammar==0.2.7 xxhash zstandard
  dill jsonschema
)

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$HERE/lib.sh"
# pip's resolver lists the sglang requirements left out on purpose: not news.
PIP_NOISE='^sglang .* requires \|dependency resolver'

# The CPU ops sglang imports from sgl_kernel at module level when SGLANG_USE_CPU_ENGINE=1.
# The tiny Llama with the torch_native attention and pytorch sampling backends calls none
# of them (an instrumented run: prefill, decode, batching, aborts); the one on the plain
# decode path is written in torch, the speculative-decoding and cache-move ones fail loudly.
write_sgl_kernel_stub() {
  local site
  site="$(purelib)"
  mkdir -p "$site/sgl_kernel"
  cat >"$site/sgl_kernel/__init__.py" <<'PY'
"""CPU stand-ins for sgl_kernel's native ops, written by tether's tests/engines/sglang_cpu.sh.

Enough for `SGLANG_USE_CPU_ENGINE=1` imports to succeed; with no native ops registered,
`cpu_has_amx_support()` is False and sglang uses its own torch layers.
"""

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req, start:end] = the next (end - start) entries of out_cache_loc."""
    taken = 0
    for req, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    ):
        req_to_token[req, start:end] = out_cache_loc[taken : taken + end - start]
        taken += end - start


def _unsupported(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: not in tether's CPU test stub")

    op.__name__ = name
    return op


copy_all_layer_kv_cache_cpu = _unsupported("copy_all_layer_kv_cache_cpu")
rotate_input_ids_cpu = _unsupported("rotate_input_ids_cpu")
fill_accept_out_cache_loc_cpu = _unsupported("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _unsupported("fill_bonus_tokens_cpu")
assign_draft_cache_locs_contiguous_cpu = _unsupported("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _unsupported("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _unsupported("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _unsupported("verify_tree_greedy_cpu")
build_draft_decode_metadata_cpu = _unsupported("build_draft_decode_metadata_cpu")
PY
}

setup_venv() {
  if [[ -f "$VENV_STAMP" ]]; then return; fi
  new_venv "2-3 minutes"
  # torch==2.13.0+cpu is not on PyPI: pip finds it through its configured find-links
  # (/opt/wheels on our machines); elsewhere set PIP_EXTRA_INDEX_URL to PyTorch's CPU index.
  quiet_pip install --only-binary=:all: --no-deps "sglang==$SGLANG_VERSION" \
    "torchvision==$TORCHVISION_VERSION"
  quiet_pip install --only-binary=:all: "torch==$TORCH_VERSION" "triton==$TRITON_VERSION" \
    "${REQUIREMENTS[@]}"
  patch_torchvision "$(purelib)"
  write_sgl_kernel_stub
  # The imports a server start needs, in the CPU engine's mode: fails here, not in a test.
  SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -W ignore - <<'PY' >&2
import importlib.metadata as md

import torch
import torchvision  # noqa: F401  (the patch above is about this import)
import sglang.srt.entrypoints.http_server  # noqa: F401
import sglang.srt.managers.scheduler  # noqa: F401
import sglang.srt.model_executor.model_runner  # noqa: F401

assert torch.__version__ == "2.13.0+cpu", torch.__version__
print("sglang", md.version("sglang"), "torch", torch.__version__)
PY
  touch "$VENV_STAMP"
}

main() {
  mkdir -p "$CACHE"
  setup_venv
  publish_engine SGLANG "$SGLANG_VERSION"
}

main "$@"
