# shellcheck shell=bash
# Helpers sourced by the setup scripts in this directory (vllm_cpu.sh, sglang_cpu.sh,
# aiperf.sh, tiny_model.sh). Not a script of its own.

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

# publish_engine PREFIX VERSION: the tiny local model in $MODEL, then PREFIX_PYTHON,
# PREFIX_MODEL and PREFIX_VERSION in $ENV_FILE (a line each) and on stdout (one line), as
# the suites read them.
publish_engine() {
  bash "$HERE/tiny_model.sh" "$VENV/bin/python" "$MODEL"
  local line="$1_PYTHON=$VENV/bin/python $1_MODEL=$MODEL $1_VERSION=$2"
  printf '%s\n' "$line" | tr ' ' '\n' >"$ENV_FILE"
  printf '%s\n' "$line"
}
