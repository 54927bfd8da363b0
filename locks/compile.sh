#!/usr/bin/env bash
# `make lock`: (re)writes the three locks from pyproject.toml and the *.in files beside this script, with
# uv (the version locks/dev-cpu.txt pins). Every lock is exact versions with sha256 hashes of every
# dependency, direct and transitive, for Linux x86_64:
#   dev-cpu.txt     make setup (CPython 3.11): pdserve + the dev, cluster and nixl extras, CPU torch
#   image-cpu.txt   the CPU image (python:3.11 base): runtime deps, nixl, kubernetes, CPU torch
#   image-cuda.txt  the CUDA image (Ubuntu 24.04, CPython 3.12): runtime deps, nixl-cu13, kubernetes,
#                   PyPI's CUDA 13 torch
# The image locks are constrained by dev-cpu.txt, so a package in both has one version everywhere.
# By default nothing is upgraded: a lock keeps its pins unless pyproject.toml no longer admits them
# (UPGRADE=1 moves every package to its newest release; UPGRADE_PACKAGE=name moves one).
# env: UV (default .venv/bin/uv); TORCH_CPU_FIND_LINKS: a directory or page of wheels holding
#      torch 2.13.0+cpu (default: PyTorch's CPU index).
set -euo pipefail
cd "$(dirname "$0")/.."
UV="${UV:-.venv/bin/uv}"
common=(--quiet --generate-hashes --python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock")
if [[ "${UPGRADE:-0}" == 1 ]]; then common+=(--upgrade); fi
if [[ -n "${UPGRADE_PACKAGE:-}" ]]; then common+=(--upgrade-package "$UPGRADE_PACKAGE"); fi
if [[ -n "${TORCH_CPU_FIND_LINKS:-}" ]]; then
  cpu_torch=(--find-links "$TORCH_CPU_FIND_LINKS")
else
  cpu_torch=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
fi
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT

# Each lock starts from its current self (uv keeps those pins) and is replaced only when uv succeeds.
compile() {  # compile OUT ARGS...
  local out="$1"; shift
  if [[ -f "locks/$out" ]]; then cp "locks/$out" "$tmp/$out"; fi
  "$UV" pip compile "${common[@]}" -o "$tmp/$out" "$@"
  mv "$tmp/$out" "locks/$out"
  echo "locks/$out: $(grep -c '^[a-z0-9]' "locks/$out") packages"
}

compile dev-cpu.txt pyproject.toml --extra dev --extra cluster --extra nixl locks/tools.in \
  -c locks/cpu-torch.txt --python-version 3.11 "${cpu_torch[@]}"
compile image-cpu.txt pyproject.toml --extra nixl locks/image.in locks/tools.in \
  -c locks/cpu-torch.txt -c locks/dev-cpu.txt --python-version 3.11 "${cpu_torch[@]}"
# The dev lock's pins apply to the CUDA image too, except the torch build and what comes with it.
sed -n -E 's/^([a-z0-9][^ ]*==[^ ]+).*/\1/p' locks/dev-cpu.txt | grep -v -E '^(torch|triton|nixl-cu12)==' \
  > "$tmp/cuda-constraints.txt"
compile image-cuda.txt pyproject.toml locks/image.in locks/image-cuda.in locks/tools.in \
  -c "$tmp/cuda-constraints.txt" --python-version 3.12
