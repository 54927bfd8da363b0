#!/usr/bin/env bash
# Delete the e2e kind cluster (everything in it goes with it).
set -euo pipefail
KIND_CLUSTER="${KIND_CLUSTER:-pdserve-e2e}"
if command -v kind >/dev/null && kind get clusters 2>/dev/null | grep -qx "$KIND_CLUSTER"; then
  kind delete cluster --name "$KIND_CLUSTER"
fi
