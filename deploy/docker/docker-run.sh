#!/usr/bin/env bash
# tether with plain `docker run`, two ways. Run from the repository root.
#
#   deploy/docker/docker-run.sh host   engine already running on this host's 127.0.0.1:8000
#                                      (e.g. `VLLM_SERVER_DEV_MODE=1 vllm serve M --host
#                                      127.0.0.1 --port 8000`): tether shares the host network
#   deploy/docker/docker-run.sh vllm   vLLM's official image and tether in one shared network
#                                      namespace (like a pod); only tether's port published
#   deploy/docker/docker-run.sh stop   stop what `vllm` started: tether first (it drains and
#                                      sends its last aborts), then the engine
#
# Env: TETHER_IMAGE (default tether:local, built if missing), ENV_FILE (config/vllm.env),
#      MODEL, VLLM_VERSION, HF_TOKEN, TETHER_ADMIN_TOKEN (enables POST /admin/abort).
set -euo pipefail

TETHER_IMAGE=${TETHER_IMAGE:-tether:local}
ENV_FILE=${ENV_FILE:-config/vllm.env}
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
VLLM_VERSION=${VLLM_VERSION:-v0.32.0}

# tether's own hardening, the same in both ways: read-only root FS, no capabilities,
# stop timeout above TETHER_SHUTDOWN_GRACE (docker's default of 10 s would cut the drain).
tether_flags=(
  --env-file "$ENV_FILE"
  --read-only --tmpfs /tmp:size=16m
  --cap-drop ALL --security-opt no-new-privileges
  --stop-timeout 50
  --restart unless-stopped
)
# Only passed when set, so an empty token never reaches tether.
if [[ -n "${TETHER_ADMIN_TOKEN:-}" ]]; then
  tether_flags+=(-e TETHER_ADMIN_TOKEN)
fi

ensure_image() {
  if ! docker image inspect "$TETHER_IMAGE" >/dev/null 2>&1; then
    docker build -t "$TETHER_IMAGE" .
  fi
}

case "${1:-}" in
  host)
    ensure_image
    # Host network: tether listens on the host's :8080 (clients) and 127.0.0.1:9090 (admin)
    # and reaches the engine on the host's loopback.
    docker run -d --name tether --network host "${tether_flags[@]}" \
      -e TETHER_ADMIN_HOST=127.0.0.1 "$TETHER_IMAGE"
    ;;
  vllm)
    ensure_image
    # 1. The namespace owner publishes tether's ports (admin on the host's loopback only).
    docker run -d --name tether-pod \
      -p 8080:8080 -p 127.0.0.1:9090:9090 \
      --restart unless-stopped \
      registry.k8s.io/pause:3.10
    # 2. vLLM on 127.0.0.1 inside that namespace: reachable by tether only.
    #    VLLM_SERVER_DEV_MODE=1 adds POST /abort_requests for tether's aborts.
    docker run -d --name vllm --network container:tether-pod \
      --gpus all --ipc host \
      -e VLLM_SERVER_DEV_MODE=1 -e HF_TOKEN \
      -v "${HF_CACHE:-$HOME/.cache/huggingface}:/root/.cache/huggingface" \
      --restart unless-stopped \
      "vllm/vllm-openai:${VLLM_VERSION}" \
      --model "$MODEL" --host 127.0.0.1 --port 8000
    # 3. tether in front.
    docker run -d --name tether --network container:tether-pod \
      "${tether_flags[@]}" "$TETHER_IMAGE"
    ;;
  stop)
    docker stop tether || true
    docker stop vllm tether-pod || true
    docker rm tether vllm tether-pod || true
    ;;
  *)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
