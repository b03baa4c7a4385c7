# shellcheck shell=bash
# What the check scripts (.ci/deploy-checks.sh, .ci/observability-checks.sh) share: the step
# and check reporting, free ports, and stopping the processes they started. Sourced after
# the script has set PY (the caller's python) and WORK (its scratch directory).

START=$SECONDS
CHECKS=0

step() { printf '\n=== %s  (+%ss)\n' "$*" "$((SECONDS - START))"; }
ok() { CHECKS=$((CHECKS + 1)); printf 'ok: %s\n' "$*"; }
die() { printf 'FAILED: %s\n' "$*" >&2; exit 1; }

# free_ports N: N distinct TCP ports free on this host right now.
free_ports() {
  "$PY" -c '
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}

# Processes started in the background (append "$!"); stop_pids stops them all.
PIDS=()
stop_pids() {
  local id
  for id in "${PIDS[@]}"; do
    kill "$id" 2>/dev/null || true
    wait "$id" 2>/dev/null || true
  done
}
