#!/usr/bin/env bash
# Remove what the kind lane installed: its namespace (every release in it). The cluster stays (it may be
# shared, as k8s-local's `kp` is); DELETE_CLUSTER=1 also deletes the lane's own cluster (never `kp`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
command -v kubectl >/dev/null || exit 0
if kubectl --context "$CTX" get namespace "$NAMESPACE" >/dev/null 2>&1; then
  kubectl --context "$CTX" delete namespace "$NAMESPACE" --wait=true --timeout=180s
fi
if [[ "${DELETE_CLUSTER:-0}" == 1 && "$KIND_CLUSTER" != kp ]] && cluster_exists; then
  kind delete cluster --name "$KIND_CLUSTER"
fi
