#!/usr/bin/env bash
# `make kind-test`: the e2e suite against the Helm chart on kind (cluster, CPU image, kind load, helm
# install with values-kind.yaml, port-forward to the router; see tests/e2e/e2e_targets.py).
# Where Docker or kind is not usable the kind lane is skipped by pytest with the reason printed.
# PDSERVE_KIND_KEEP=1 keeps the cluster afterwards (faster reruns; add SKIP_BUILD=1 to reuse the image).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
export HELM="${HELM:-$ROOT/.tools/node_modules/.bin/helm}"
if ! docker info >/dev/null 2>&1; then
  echo "kind-test: no usable Docker engine (docker info failed); the kind lane will be skipped." >&2
elif ! command -v kind >/dev/null; then
  echo "kind-test: kind is not installed; the kind lane will be skipped." >&2
fi
PDSERVE_E2E_TARGETS=kind exec "$ROOT/.venv/bin/python" -m pytest -q -rs tests/e2e "$@"
