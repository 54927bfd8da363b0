#!/usr/bin/env bash
# `make container-test`: the container lane, from nothing.
#   1. a Docker engine (docker-up.sh: reuse, or install docker.io and start dockerd),
#   2. the image and the lane's Redis image (build-image.sh; a local base image and torch index where the
#      registry or the PyTorch index cannot be reached),
#   3. tests/container: `docker run IMAGE --help`, the image's defaults (non-root, read-only root, health
#      check), then the e2e suite, the chart's probes and a `docker stop` drain against the chart's pods as
#      containers, for KV over NIXL (UCX over TCP) and over TCP.
# env: IMAGE (pdserve:<appVersion>-cpu); PDSERVE_CONTAINER_TRANSPORTS (nixl,tcp);
#      PDSERVE_CONTAINER_LANE_OPTIONAL=1: where no Docker engine can be had, print why and exit 0 (CI).
# Extra arguments go to pytest. A dockerd this script started is stopped at the end (images stay on disk).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
lane_start=$SECONDS
rm -f "$STATE/dockerd.pid"
if ! "$ROOT/deploy/container/docker-up.sh"; then
  if [[ "${PDSERVE_CONTAINER_LANE_OPTIONAL:-0}" == 1 ]]; then
    log "SKIPPED: the container lane needs a Docker engine and none can be started here (reason above)"
    exit 0
  fi
  exit 3
fi
stop_dockerd() {
  if [[ -f "$STATE/dockerd.pid" ]]; then
    local pid; pid="$(cat "$STATE/dockerd.pid")"
    log "stopping the dockerd this lane started (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    rm -f "$STATE/dockerd.pid"
  fi
}
trap stop_dockerd EXIT

export IMAGE="${IMAGE:-pdserve:${APP_VERSION}-cpu}"
"$ROOT/deploy/container/build-image.sh"
pick_docker
export PDSERVE_CONTAINER_IMAGE="$IMAGE"
export HELM="${HELM:-$ROOT/.tools/node_modules/.bin/helm}"
test_start=$SECONDS
status=0
# File order: the tests share one cluster per transport and this order restarts the fewest containers
# (each test also restores the pool size it needs, so a random order passes too, only slower).
"$ROOT/.venv/bin/python" -m pytest -q -rs -p no:cacheprovider --randomly-dont-reorganize tests/container "$@" \
  || status=$?
log "tests: $((SECONDS - test_start)) s; whole lane: $((SECONDS - lane_start)) s"
exit "$status"
