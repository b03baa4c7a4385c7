#!/usr/bin/env bash
# tether against a real vLLM (CPU build) and real clients: tests/real_vllm (issue 5).
# See .ci/real-engine-suite.sh.
exec bash "$(dirname "${BASH_SOURCE[0]}")/real-engine-suite.sh" vllm
