#!/usr/bin/env bash
# tether against a real SGLang (0.5.23 on CPU torch) and real clients: tests/real_sglang
# (issue 12). See .ci/real-engine-suite.sh.
exec bash "$(dirname "${BASH_SOURCE[0]}")/real-engine-suite.sh" sglang
