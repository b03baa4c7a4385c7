# shellcheck shell=bash
# Helpers sourced by the setup scripts in this directory (vllm_cpu.sh, vllm_realtime.sh,
# sglang_cpu.sh, llamacpp.sh, aiperf.sh, tiny_model.sh). Not a script of its own.

# log MESSAGE...: on stderr, prefixed with the running script's name.
log() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }

# pick_python: the interpreter new venvs are made with: $PYTHON, else python3.11, else python3.
pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
  if command -v python3.11 >/dev/null 2>&1; then echo python3.11; return; fi
  echo python3
}

# quiet_pip ARGS...: pip in $VENV, on stderr, without the find-links noise and without lines
# matching $PIP_NOISE (a grep pattern, when the caller sets one); fails when pip fails.
quiet_pip() {
  local noise='^WARNING: \(Location\|Skipping\)'
  if [[ -n "${PIP_NOISE:-}" ]]; then noise="$noise\\|$PIP_NOISE"; fi
  "$VENV/bin/python" -m pip --quiet --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "$noise" || true; } >&2
}

# new_venv HOW_LONG: $VENV made afresh with pick_python's interpreter; HOW_LONG (e.g.
# "2 minutes") is what the log line says the whole build takes.
new_venv() {
  local py
  py="$(pick_python)"
  log "creating $VENV with $py (takes about $1)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$py" -m venv "$VENV"
}

# purelib: $VENV's site-packages directory.
purelib() {
  "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

# publish_engine PREFIX VERSION: the tiny local model in $MODEL, then PREFIX_PYTHON,
# PREFIX_MODEL and PREFIX_VERSION in $ENV_FILE (a line each) and on stdout (one line), as
# the suites read them.
publish_engine() {
  bash "$HERE/tiny_model.sh" "$VENV/bin/python" "$MODEL"
  local line="$1_PYTHON=$VENV/bin/python $1_MODEL=$MODEL $1_VERSION=$2"
  printf '%s\n' "$line" | tr ' ' '\n' >"$ENV_FILE"
  printf '%s\n' "$line"
}

# patch_torchvision DIR: make the torchvision in DIR (a site-packages or --target directory)
# import beside CPU torch, with $VENV's python. Its PyPI build is CUDA: its C++ ops cannot
# load beside CPU torch, and _meta_registrations.py then fails at import ("operator
# torchvision::nms does not exist") because two of its decorators skip the `_has_ops()` guard
# the file uses everywhere else. The patched file names the script that patched it.
patch_torchvision() {
  "$VENV/bin/python" - "$1" "$(basename "$0")" <<'PY' >&2
import pathlib
import sys

path = pathlib.Path(sys.argv[1]) / "torchvision" / "_meta_registrations.py"
text = path.read_text()
guard = f'''

def register_fake_if_ops(op_name):
    # Patched by tether's tests/engines/{sys.argv[2]}: the CUDA build's ops do not load
    # beside CPU torch; register fakes only when they did, as register_meta does.
    if torchvision.extension._has_ops():
        return torch.library.register_fake(op_name)
    return lambda fn: fn
'''
anchor = '\n\n@register_meta("roi_align")'
assert anchor in text and "@torch.library.register_fake(" in text, "torchvision changed"
text = text.replace("@torch.library.register_fake(", "@register_fake_if_ops(")
path.write_text(text.replace(anchor, guard + anchor, 1))
print("patched", path)
PY
}

# train_tokenizer PYTHON DIR SPECIAL...: DIR/tokenizer.json, a byte-level BPE tokenizer of
# 4096 tokens with these special tokens, trained with PYTHON (which has `tokenizers`) on local
# text: that interpreter's own standard library, sorted, so the result is the same each time.
train_tokenizer() {
  local python="$1"
  shift
  "$python" - "$@" <<'PY' >&2
import pathlib
import sys
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

out = pathlib.Path(sys.argv[1])
specials = sys.argv[2:]
stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
files = sorted(str(p) for p in stdlib.glob("*.py"))[:200]
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
PY
}
