#!/usr/bin/env bash
# Build the tiny local model the real-engine suites serve (tests/engines/vllm_cpu.sh and
# sglang_cpu.sh): a tiny Llama config, a byte-level BPE tokenizer trained here on local text,
# and a chat template. Nothing is downloaded: the engines run it with `--load-format dummy`.
#
# Usage: tiny_model.sh PYTHON DIR
#   PYTHON: an interpreter with `tokenizers` and `transformers` (an engine's venv);
#   DIR: where the model goes.
# Idempotent: a stamp file in DIR makes a second run return at once; a lock on DIR.lock lets
# both engines' setup scripts run at the same time.
set -euo pipefail

# Bump when the recipe below changes, so existing models are rebuilt. "3" is the recipe
# vllm_cpu.sh stamped before the model build moved here: existing caches stay valid.
readonly MODEL_RECIPE="3"

if (($# != 2)); then
  echo "usage: $0 PYTHON DIR" >&2
  exit 2
fi
readonly PYTHON_BIN="$1" MODEL="$2"
readonly STAMP="$MODEL/.tether-ready-$MODEL_RECIPE"

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if [[ -f "$STAMP" ]]; then exit 0; fi
mkdir -p "$(dirname "$MODEL")"
exec 9>"$MODEL.lock"
flock 9
if [[ -f "$STAMP" ]]; then exit 0; fi  # built by the setup script we waited for

log "building tiny model in $MODEL"
rm -rf "$MODEL"
mkdir -p "$MODEL"
train_tokenizer "$PYTHON_BIN" "$MODEL" \
  "<s>" "</s>" "<unk>" "<|user|>" "<|assistant|>" "<|system|>"
"$PYTHON_BIN" - "$MODEL" <<'PY' >&2
"""Write a tiny Llama config and a chat template beside its tokenizer (train_tokenizer, lib.sh)."""
import json
import pathlib
import sys

from tokenizers import Tokenizer

out = pathlib.Path(sys.argv[1])
tok = Tokenizer.from_file(str(out / "tokenizer.json"))
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

from transformers import AutoTokenizer  # noqa: E402  (check the result loads as the engines will)

t = AutoTokenizer.from_pretrained(str(out))
prompt = t.apply_chat_template(
    [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
)
print("tokenizer ok: vocab", vocab, "chat prompt", repr(prompt), "tokens", len(t(prompt).input_ids))
PY
touch "$STAMP"
