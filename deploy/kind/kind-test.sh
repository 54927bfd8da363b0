#!/usr/bin/env bash
# `make kind-test`: the e2e suite against the Helm chart on a real Kubernetes (kind).
#   1. tools and a cluster (lib.sh): stock kind, or a k8s-local machine's; where neither works and
#      /work/shared/k8s-local/setup.sh can run (root), it provisions one (K8S_LOCAL_SETUP; its build
#      outputs stay under K8S_LOCAL_DIR, so a second provisioning takes minutes, not half an hour);
#   2. tests/e2e with PDSERVE_E2E_TARGETS=kind: the fixture runs up.sh (image build, kind load, helm install),
#      then test_e2e.py and test_kind.py in file order.
# env: PDSERVE_KIND_LANE_OPTIONAL=1: where no cluster can be had, print why and exit 0 (CI).
#      PDSERVE_KIND_KEEP=1 keeps the namespace afterwards. Extra arguments go to pytest.
#   kind-test.sh --estimate   prints the seconds a run needs here: the last run's measured total (else
#                             KIND_LANE_DEFAULT_S) plus provisioning where this machine has no cluster yet.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
K8S_LOCAL_SETUP="${K8S_LOCAL_SETUP:-$ROOT/../shared/k8s-local/setup.sh}"
KIND_LANE_DEFAULT_S="${KIND_LANE_DEFAULT_S:-1200}"
PROVISION_BUILT_S=180      # setup.sh all with its Go build and rootfs cached (k8s-local README: ~2 min)
PROVISION_SCRATCH_S=1800   # setup.sh all from an empty K8S_LOCAL_DIR (k8s-local README: 20-30 min)

provision_seconds() {
  if [[ -z "$(kind_unusable)" ]] && cluster_exists; then echo 0
  elif [[ -x "$K8S_LOCAL_DIR/bin/kubectl" && -d "$K8S_LOCAL_DIR/rootfs/node/usr" ]]; then echo "$PROVISION_BUILT_S"
  else echo "$PROVISION_SCRATCH_S"; fi
}

if [[ "${1:-}" == --estimate ]]; then
  last="$(sed -n 's/.*"lane_seconds": \([0-9]*\).*/\1/p' "$STATE/lane.json" 2>/dev/null || true)"
  echo $(( ${last:-$KIND_LANE_DEFAULT_S} + $(provision_seconds) ))
  exit 0
fi

lane_start=$SECONDS
: >"$STATE/times.jsonl"
reason="$(kind_unusable)"
if [[ -n "$reason" && -x "$K8S_LOCAL_SETUP" && "$(id -u)" == 0 ]]; then
  log "$reason: provisioning a local cluster with $K8S_LOCAL_SETUP all"
  timed provision "$K8S_LOCAL_SETUP" all >"$STATE/provision.log" 2>&1 \
    || { tail -30 "$STATE/provision.log" >&2; log "provisioning failed: $STATE/provision.log"; }
  unset KIND_CLUSTER KIND_NODE_IMAGE
  source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
  reason="$(kind_unusable)"
fi
[[ -z "$reason" ]] && reason="$(cluster_unreachable)"
if [[ -n "$reason" ]]; then
  log "SKIPPED: the kind lane needs a cluster and none can be had here: $reason"
  [[ "${PDSERVE_KIND_LANE_OPTIONAL:-0}" == 1 ]] && exit 0
  exit 3
fi
log "cluster $KIND_CLUSTER (kubeconfig ${KUBECONFIG:-~/.kube/config}), namespace $NAMESPACE"
status=0
PDSERVE_E2E_TARGETS=kind "$ROOT/.venv/bin/python" -m pytest -q -rs -p no:cacheprovider --randomly-dont-reorganize \
  --durations=0 --junitxml "$STATE/junit.xml" tests/e2e "$@" || status=$?
total=$((SECONDS - lane_start))
printf '{"lane_seconds": %d, "status": %d}\n' "$total" "$status" >"$STATE/lane.json"
log "kind lane: $total s (steps: $STATE/times.jsonl; per-test reports: $STATE/e2e-*.json)"
exit "$status"
