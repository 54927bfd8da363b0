#!/usr/bin/env bash
# Make sure a Docker engine answers, as the container lane's own set-up: reuse a running one; else, as
# root, install Debian's docker.io with apt when dockerd is missing and start dockerd in the background
# (its pid goes to $STATE/dockerd.pid, its log to $STATE/dockerd.log; lane.sh stops it afterwards).
# Exit 0: an engine answers. Exit 3: none can be had here, with the reason on stderr.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
unavailable() { log "no Docker engine: $*"; exit 3; }

if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  log "using the running Docker engine ($(docker info --format '{{.ServerVersion}}, {{.Driver}}' 2>/dev/null))"
  exit 0
fi
[[ "$(id -u)" == 0 ]] || unavailable "none is running and starting dockerd needs root"
if ! command -v dockerd >/dev/null; then
  command -v apt-get >/dev/null || unavailable "dockerd is not installed and there is no apt-get to install docker.io"
  log "installing docker.io with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends docker.io; } >"$STATE/apt-docker.log" 2>&1 \
    || { tail -5 "$STATE/apt-docker.log" >&2; unavailable "apt-get install docker.io failed (log: $STATE/apt-docker.log)"; }
fi
log "starting dockerd (log: $STATE/dockerd.log)"
dockerd >"$STATE/dockerd.log" 2>&1 &
echo $! >"$STATE/dockerd.pid"
for _ in $(seq 60); do
  if docker info >/dev/null 2>&1; then
    log "dockerd $(docker info --format '{{.ServerVersion}}, storage {{.Driver}}, cgroup v{{.CgroupVersion}}') is up"
    exit 0
  fi
  kill -0 "$(cat "$STATE/dockerd.pid")" 2>/dev/null || break
  sleep 1
done
tail -5 "$STATE/dockerd.log" >&2
kill "$(cat "$STATE/dockerd.pid")" 2>/dev/null || true
rm -f "$STATE/dockerd.pid"
unavailable "dockerd did not come up here (it needs root, cgroups and overlay or vfs storage; see $STATE/dockerd.log)"
