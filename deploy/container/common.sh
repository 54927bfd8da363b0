# Shared by the container lane's scripts (sourced, not run). Sets ROOT, STATE, APP_VERSION and DOCKER.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# Lane state (wheelhouse, logs, build report): git- and docker-ignored.
STATE="${PDSERVE_LANE_STATE:-$ROOT/.run/container-lane}"
APP_VERSION="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$ROOT/deploy/helm/pdserve/Chart.yaml")"
mkdir -p "$STATE"

log() { printf '[container-lane] %s\n' "$*" >&2; }

# The Dockerfile needs BuildKit. A docker CLI builds with it through the buildx plugin (Docker >= 23) or,
# before 23, through DOCKER_BUILDKIT=1. Pick the first `docker` on PATH that can; $DOCKER overrides.
pick_docker() {
  if [[ -n "${DOCKER:-}" ]]; then return 0; fi
  local candidate major
  while read -r candidate; do
    [[ -x "$candidate" ]] || continue
    if "$candidate" buildx version >/dev/null 2>&1; then DOCKER="$candidate"; return 0; fi
    major="$("$candidate" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)"
    if [[ "$major" =~ ^[0-9]+$ ]] && (( major < 23 )); then DOCKER="$candidate"; return 0; fi
  done < <(type -ap docker | awk '!seen[$0]++')
  log "no docker CLI here can build with BuildKit (needs the buildx plugin, or a docker CLI < 23)"
  return 1
}

docker_build() {  # docker_build ARGS... : a BuildKit build with the chosen client
  DOCKER_BUILDKIT=1 "$DOCKER" build "$@"
}
