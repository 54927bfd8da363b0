#!/usr/bin/env bash
# Make a Debian bookworm base image with python3 + venv locally, for machines that cannot pull
# python:3.11-slim-bookworm from a registry:  deploy/container/make-base.sh [IMAGE]   (default
# pdserve-base:bookworm). Needs root and debootstrap (installed with apt-get when missing). Reuses IMAGE
# if present.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
IMAGE="${1:-pdserve-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  log "base image $IMAGE already present"; exit 0
fi
if ! command -v debootstrap >/dev/null; then
  [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null || { log "debootstrap is not installed"; exit 1; }
  log "installing debootstrap with apt-get"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >"$STATE/apt-debootstrap.log" 2>&1 \
    || { tail -5 "$STATE/apt-debootstrap.log" >&2; exit 1; }
fi
ROOTFS="$(mktemp -d "$STATE/rootfs.XXXXXX")"
trap 'rm -rf "$ROOTFS"' EXIT
log "debootstrap bookworm (minbase + python3, python3-venv, ca-certificates) into $ROOTFS"
start=$SECONDS
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$ROOTFS" "$MIRROR" \
  >"$STATE/debootstrap.log" 2>&1 || { tail -20 "$STATE/debootstrap.log" >&2; exit 1; }
# What a slim image leaves out: package caches and lists, documentation, locales.
rm -rf "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/usr/share/locale/*
tar --numeric-owner -C "$ROOTFS" -c . | docker import -c 'CMD ["python3"]' - "$IMAGE" >/dev/null
log "base image $IMAGE made in $((SECONDS - start)) s ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
