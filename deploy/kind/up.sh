#!/usr/bin/env bash
# Create (or reuse) the kind cluster, build the CPU image, load it, install the chart with values-kind.yaml
# and wait until every pod is Ready. Idempotent; the e2e kind lane and `make kind-test` call it.
#   env: KIND_CLUSTER (pdserve-e2e), NAMESPACE (pdserve-e2e), RELEASE (pdserve), HELM (helm binary),
#        IMAGE (pdserve:<appVersion>-cpu), SKIP_BUILD=1 to reuse an image already loaded.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
KIND_CLUSTER="${KIND_CLUSTER:-pdserve-e2e}"
NAMESPACE="${NAMESPACE:-pdserve-e2e}"
RELEASE="${RELEASE:-pdserve}"
HELM="${HELM:-$ROOT/.tools/node_modules/.bin/helm}"
APP_VERSION="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$ROOT/deploy/helm/pdserve/Chart.yaml")"
IMAGE="${IMAGE:-pdserve:${APP_VERSION}-cpu}"
CTX="kind-${KIND_CLUSTER}"

log() { printf '[kind-up] %s\n' "$*" >&2; }

docker info >/dev/null 2>&1 || { log "docker engine not reachable (docker info failed)"; exit 3; }
command -v kind >/dev/null || { log "kind not on PATH"; exit 3; }
command -v kubectl >/dev/null || { log "kubectl not on PATH"; exit 3; }

if ! kind get clusters 2>/dev/null | grep -qx "$KIND_CLUSTER"; then
  log "creating kind cluster $KIND_CLUSTER"
  kind create cluster --name "$KIND_CLUSTER" --config "$ROOT/deploy/kind/kind-config.yaml" --wait 180s
fi

if [[ "${SKIP_BUILD:-0}" != "1" ]]; then
  log "building $IMAGE (VARIANT=cpu)"
  docker build --build-arg VARIANT=cpu -t "$IMAGE" "$ROOT"
  log "loading $IMAGE into $KIND_CLUSTER"
  kind load docker-image "$IMAGE" --name "$KIND_CLUSTER"
fi

kubectl --context "$CTX" create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl --context "$CTX" apply -f -
log "installing release $RELEASE into $NAMESPACE"
"$HELM" upgrade --install "$RELEASE" "$ROOT/deploy/helm/pdserve" \
  --kube-context "$CTX" --namespace "$NAMESPACE" \
  -f "$ROOT/deploy/helm/values-kind.yaml" \
  --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" \
  --wait --timeout 15m
for d in router prefill decode; do
  kubectl --context "$CTX" -n "$NAMESPACE" rollout status "deploy/${RELEASE}-${d}" --timeout=600s
done
kubectl --context "$CTX" -n "$NAMESPACE" get pods -o wide >&2
log "ready: kubectl --context $CTX -n $NAMESPACE port-forward svc/${RELEASE}-router 50051:50051"
