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

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly HERE
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$HERE/lib.sh"

if [[ ! -f "$STAMP" ]]; then
  new_venv "a minute"
  quiet_pip install --only-binary=:all: "aiperf==$AIPERF_VERSION"
  "$VENV/bin/aiperf" --help >/dev/null
  touch "$STAMP"
fi
printf 'AIPERF=%s\n' "$VENV/bin/aiperf"
