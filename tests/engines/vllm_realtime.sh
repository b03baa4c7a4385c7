#!/usr/bin/env bash
# Set up what vLLM's Realtime API (`/v1/realtime`, streaming transcription) needs beside the
# vLLM venv of vllm_cpu.sh: a tiny Qwen3-ASR realtime model made locally, and torchvision.
#
# vLLM registers `/v1/realtime` only for a model with the `realtime` task; Qwen3-ASR
# (`Qwen3ASRRealtimeGeneration`) is the one whose files can all be made here (Voxtral
# Realtime needs Mistral's tekken tokenizer). The model is a config (audio encoder and text
# decoder, hidden 64, 2 layers each), a byte-level BPE tokenizer trained on local text with
# Qwen's special tokens, and Qwen3-ASR's feature extractor settings (16 kHz, 128 mel bins),
# served with `--load-format dummy`: nothing is downloaded but packages.
#
# torchvision: vLLM imports Qwen3-ASR through Qwen2-VL, whose transformers image processor
# imports torchvision at module level, and vllm_cpu.sh removes it from the venv (fix 1
# there). It goes into a directory of its own that only the realtime configuration puts on
# PYTHONPATH, so the other configurations keep running the venv as it is. Its PyPI build is
# CUDA: patched as sglang_cpu.sh patches it (patch_torchvision, lib.sh), so it imports
# beside CPU torch.
#
# Idempotent: stamp files make a second run take well under a second.
# Output: the last line on stdout is machine-readable,
#   VLLM_REALTIME_MODEL=<model dir> VLLM_REALTIME_PYTHONPATH=<torchvision dir>
# and the same assignments are written to "$CACHE/vllm-realtime.env" (sourceable by bash).
#
# Env: TETHER_ENGINE_CACHE (default ~/.cache/tether/engines).
set -euo pipefail

readonly TORCHVISION_VERSION="0.28.0"  # the release built for torch 2.13
readonly CACHE="${TETHER_ENGINE_CACHE:-$HOME/.cache/tether/engines}"
readonly MODEL="$CACHE/tiny-qwen3-asr"
readonly EXTRAS="$CACHE/vllm-realtime-torchvision-$TORCHVISION_VERSION"
readonly ENV_FILE="$CACHE/vllm-realtime.env"
# Bump when the model or the extras recipe below changes, so existing caches are rebuilt.
readonly RECIPE="1"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly HERE

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$HERE/lib.sh"

# The vLLM venv (built by vllm_cpu.sh if missing): its python, from that script's last line.
vllm_python() {
  local line
  line="$(bash "$HERE/vllm_cpu.sh" | tail -n 1)"
  local assignment
  for assignment in $line; do
    if [[ "$assignment" == VLLM_PYTHON=* ]]; then
      echo "${assignment#VLLM_PYTHON=}"
      return
    fi
  done
  echo "vllm_cpu.sh printed no VLLM_PYTHON" >&2
  return 1
}

setup_extras() {
  local stamp="$EXTRAS/.tether-ready-$RECIPE"
  if [[ -f "$stamp" ]]; then return; fi
  log "installing torchvision $TORCHVISION_VERSION into $EXTRAS"
  rm -rf "$EXTRAS"
  quiet_pip install --only-binary=:all: --no-deps --target "$EXTRAS" \
    "torchvision==$TORCHVISION_VERSION"
  patch_torchvision "$EXTRAS"
  # The import vLLM's model inspection makes: fails here, not at the server's start.
  PYTHONPATH="$EXTRAS" "$VENV/bin/python" -W ignore -c \
    'import vllm.model_executor.models.qwen3_asr_realtime, torchvision; print("torchvision", torchvision.__version__)' >&2
  touch "$stamp"
}

build_model() {
  local stamp="$MODEL/.tether-ready-$RECIPE"
  if [[ -f "$stamp" ]]; then return; fi
  log "building tiny Qwen3-ASR realtime model in $MODEL"
  rm -rf "$MODEL"
  mkdir -p "$MODEL"
  # The prompt vLLM builds: <|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>...
  local specials=(
    "<|endoftext|>" "<|im_start|>" "<|im_end|>"
    "<|audio_start|>" "<|audio_end|>" "<|audio_pad|>" "<asr_text>"
  )
  train_tokenizer "$VENV/bin/python" "$MODEL" "${specials[@]}"
  "$VENV/bin/python" - "$MODEL" "${specials[@]}" <<'PY' >&2
"""A tiny Qwen3-ASR realtime config beside its tokenizer (`train_tokenizer`, lib.sh, with Qwen's
special tokens), and Qwen3-ASR's feature extractor and processor settings."""
import json
import pathlib
import sys

from tokenizers import Tokenizer

out = pathlib.Path(sys.argv[1])
tok = Tokenizer.from_file(str(out / "tokenizer.json"))
vocab = tok.get_vocab_size()
ids = {token: tok.token_to_id(token) for token in sys.argv[2:]}

(out / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "Qwen2Tokenizer",
    "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
    "unk_token": None,
    # Qwen3ASRProcessor reads these as tokenizer attributes.
    "audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "model_max_length": 4096, "clean_up_tokenization_spaces": False, "errors": "replace",
    "split_special_tokens": False,
}, indent=2))
(out / "preprocessor_config.json").write_text(json.dumps({
    "feature_extractor_type": "Qwen3ASRFeatureExtractor", "processor_class": "Qwen3ASRProcessor",
    "feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30,
    "n_fft": 400, "padding_value": 0.0, "dither": 0.0, "return_attention_mask": True,
    "n_window": 50, "padding_side": "right",
}, indent=2))
(out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3ASRProcessor"}))
hidden = 64
config = {
    "architectures": ["Qwen3ASRRealtimeGeneration"],
    "model_type": "qwen3_asr",
    "thinker_config": {
        "model_type": "qwen3_asr_thinker",
        "audio_token_id": ids["<|audio_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "audio_config": {
            "model_type": "qwen3_asr_audio_encoder",
            # 128 mel bins and a window of 50 as the feature extractor and vLLM's
            # _get_feat_extract_output_lengths (chunks of 100 frames) assume.
            "num_mel_bins": 128, "n_window": 50, "n_window_infer": 800, "conv_chunksize": 500,
            "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 128,
            "d_model": 64, "downsample_hidden_size": 32, "output_dim": hidden,
            "activation_function": "gelu", "max_source_positions": 1500,
        },
        "text_config": {
            "model_type": "qwen3_asr_text",
            "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
            "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
            # M-RoPE as Qwen3-ASR has it, its sections summing to head_dim / 2.
            "rope_scaling": {
                "rope_type": "default", "mrope_section": [6, 5, 5], "interleaved": True,
                "mrope_interleaved": True,
            },
            "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
            "torch_dtype": "bfloat16",
        },
    },
    "eos_token_id": ids["<|im_end|>"],
    "pad_token_id": ids["<|endoftext|>"],
    "torch_dtype": "bfloat16",
}
(out / "config.json").write_text(json.dumps(config, indent=2))
(out / "generation_config.json").write_text(json.dumps(
    {"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}, indent=2))

import numpy as np  # noqa: E402  (check the result loads and runs as vLLM will load it)
from transformers import AutoProcessor  # noqa: E402

processor = AutoProcessor.from_pretrained(str(out))
features = processor(
    text="<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|><|im_end|>\n",
    audio=[np.zeros(16000, dtype=np.float32)],
)
print("processor ok:", type(processor).__name__, "vocab", vocab,
      "features", tuple(features["input_features"].shape))
PY
  touch "$stamp"
}

main() {
  mkdir -p "$CACHE"
  VENV="$(dirname "$(dirname "$(vllm_python)")")"
  readonly VENV
  setup_extras
  build_model
  local line="VLLM_REALTIME_MODEL=$MODEL VLLM_REALTIME_PYTHONPATH=$EXTRAS"
  printf '%s\n' "$line" | tr ' ' '\n' >"$ENV_FILE"
  printf '%s\n' "$line"
}

main "$@"
