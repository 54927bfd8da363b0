#!/usr/bin/env bash
# Build the pdserve image (and the lane's Redis image) the way the container lane needs it, on a normal
# workstation and on machines without registry access alike:
#
#   deploy/container/build-image.sh            # -> $IMAGE (pdserve:<appVersion>-cpu), $REDIS_IMAGE
#
# env: IMAGE, VARIANT (cpu), REDIS_IMAGE (pdserve-lane-redis:bookworm),
#      CPU_BASE      base image; default python:3.11-slim-bookworm, or, when that cannot be pulled, one
#                    made here with debootstrap (make-base.sh -> pdserve-base:bookworm)
#      TORCH_INDEX_URL  default: the Dockerfile's (PyTorch's CPU index); when that is unreachable, a local
#                    index of the wheels this machine's pip resolves for the lock's torch (the torch==
#                    line of locks/image-cpu.txt; local-torch-index.py), served on 127.0.0.1 for the build
#      PIP_CERT_BUNDLE  CA bundle handed to pip as a build secret
#                    (default $PIP_CERT, else /etc/ssl/certs/ca-certificates.crt when present)
# Builds run with --network host (pip inside the build then uses the host's network, and can reach the
# local index). Prints the build time and the size of every layer; writes them to $STATE/build.json.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
pick_docker
VARIANT="${VARIANT:-cpu}"
IMAGE="${IMAGE:-pdserve:${APP_VERSION}-${VARIANT}}"
REDIS_IMAGE="${REDIS_IMAGE:-pdserve-lane-redis:bookworm}"
TORCH_SPEC="$(sed -n -E 's/^(torch==[^ ]+).*/\1/p' "$ROOT/locks/image-$VARIANT.txt")"
DEFAULT_CPU_BASE="python:3.11-slim-bookworm"
DEFAULT_TORCH_INDEX="https://download.pytorch.org/whl/cpu"

if [[ -z "${CPU_BASE:-}" ]]; then
  if docker image inspect "$DEFAULT_CPU_BASE" >/dev/null 2>&1 || docker pull -q "$DEFAULT_CPU_BASE" >/dev/null 2>&1; then
    CPU_BASE="$DEFAULT_CPU_BASE"
  else
    log "cannot pull $DEFAULT_CPU_BASE (no registry reachable); making a local base image instead"
    CPU_BASE="pdserve-base:bookworm"
    "$ROOT/deploy/container/make-base.sh" "$CPU_BASE"
  fi
fi
log "base image: $CPU_BASE"

server_pid=""
cleanup() { if [[ -n "$server_pid" ]]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi; }
trap cleanup EXIT
if [[ -z "${TORCH_INDEX_URL:-}" && "$VARIANT" == cpu ]] \
   && ! curl -sfI --max-time 15 "$DEFAULT_TORCH_INDEX/torch/" >/dev/null 2>&1; then
  py="$(docker run --rm --entrypoint python3 "$CPU_BASE" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  log "$DEFAULT_TORCH_INDEX is unreachable: serving this machine's pip's wheels for $TORCH_SPEC (python $py)"
  simple="$("$ROOT/.venv/bin/python" "$ROOT/deploy/container/local-torch-index.py" "$STATE/torch-index" "$TORCH_SPEC" "$py")"
  # A fixed port keeps TORCH_INDEX_URL, and with it the build cache of every layer after it, the same from
  # build to build; a free one is taken only when that port is busy.
  port="${PDSERVE_TORCH_INDEX_PORT:-38517}"
  if curl -s --max-time 2 "http://127.0.0.1:$port/" >/dev/null 2>&1; then
    port="$("$ROOT/.venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  fi
  "$ROOT/.venv/bin/python" -m http.server --bind 127.0.0.1 --directory "$simple" "$port" >"$STATE/torch-index.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 50); do curl -sf "http://127.0.0.1:$port/torch/" >/dev/null && break; sleep 0.2; done
  curl -sf "http://127.0.0.1:$port/torch/" >/dev/null || { cat "$STATE/torch-index.log" >&2; log "local index did not start"; exit 1; }
  TORCH_INDEX_URL="http://127.0.0.1:$port/"
fi

secret=()
bundle="${PIP_CERT_BUNDLE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}"
if [[ -s "$bundle" ]]; then secret=(--secret "id=pip_cert,src=$bundle"); fi

args=(--network host --build-arg "VARIANT=$VARIANT" --build-arg "CPU_BASE=$CPU_BASE")
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL"); fi
log "building $IMAGE with $DOCKER (locks/image-$VARIANT.txt; ${TORCH_SPEC} from ${TORCH_INDEX_URL:-the Dockerfile default})"
start=$(date +%s.%N)
docker_build "${args[@]}" "${secret[@]}" --progress plain -t "$IMAGE" "$ROOT" >"$STATE/build.log" 2>&1 \
  || { tail -40 "$STATE/build.log" >&2; log "build failed; full log: $STATE/build.log"; exit 1; }
build_s=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
cached=$(grep -c '^#[0-9]* CACHED' "$STATE/build.log" || true)
log "built $IMAGE in ${build_s} s ($cached steps cached)"

start=$(date +%s.%N)
docker_build --network host --build-arg "BASE_IMAGE=$CPU_BASE" --progress plain -t "$REDIS_IMAGE" \
  -f "$ROOT/deploy/container/redis.Dockerfile" "$ROOT/deploy/container" >"$STATE/build-redis.log" 2>&1 \
  || { tail -20 "$STATE/build-redis.log" >&2; exit 1; }
redis_s=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
log "built $REDIS_IMAGE in ${redis_s} s"

"$ROOT/.venv/bin/python" "$ROOT/deploy/container/image_report.py" "$IMAGE" --docker "$DOCKER" \
  --build-seconds "$build_s" --cached-steps "$cached" --base "$CPU_BASE" --json "$STATE/build.json"
