#!/usr/bin/env bash
# Install aiperf (the load generator used by tests/real_vllm) in its own cached venv.
#
# aiperf pulls in ~120 packages (pandas, scipy, transformers, its own pytest pin...), which
# would fight tether's dev dependencies, so it never goes into tether's venv.
# Idempotent: a stamp file makes a second run take well under a second.
# Output: last line on stdout is `AIPERF=<path to the aiperf executable>`.
# Env: TETHER_ENGINE_CACHE (default ~/.cache/tether/engines), PYTHON (default python3.11 or python3).
set -euo pipefail

readonly AIPERF_VERSION="0.13.0"
readonly CACHE="${TETHER_ENGINE_CACHE:-$HOME/.cache/tether/engines}"
readonly VENV="$CACHE/aiperf-$AIPERF_VERSION"
readonly STAMP="$VENV/.tether-ready-1"

log() { printf '[aiperf.sh] %s\n' "$*" >&2; }

pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
  if command -v python3.11 >/dev/null 2>&1; then echo python3.11; return; fi
  echo python3
}

if [[ ! -f "$STAMP" ]]; then
  log "creating $VENV (takes about a minute)"
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  "$(pick_python)" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --only-binary=:all: \
    "aiperf==$AIPERF_VERSION" 2>&1 | { grep -v '^WARNING: \(Location\|Skipping\)' || true; } >&2
  "$VENV/bin/aiperf" --help >/dev/null
  touch "$STAMP"
fi
printf 'AIPERF=%s\n' "$VENV/bin/aiperf"
