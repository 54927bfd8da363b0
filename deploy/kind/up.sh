#!/usr/bin/env bash
# The kind lane's deployment, idempotent: the cluster (reused, else created: lib.sh says which), the CPU
# image and the Redis image (deploy/container/build-image.sh: works without a registry), `kind load`, then
# `helm upgrade --install` with values-kind.yaml, waiting until every pod is Ready. Extra arguments go to
# helm (the e2e suite installs a second, TCP release with `RELEASE=pdserve-tcp up.sh --set ...`).
#   env: see lib.sh; SKIP_BUILD=1 reuses images already loaded.
# Each step's seconds go to $STATE/times.jsonl (docs/deploy.md quotes them).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

reason="$(kind_unusable)"
if [[ -n "$reason" ]]; then log "$reason"; exit 3; fi

create_cluster() {
  if [[ -n "$KIND_NODE_IMAGE" ]]; then
    kind create cluster --name "$KIND_CLUSTER" --image "$KIND_NODE_IMAGE" --wait 300s
  else
    kind create cluster --name "$KIND_CLUSTER" --config "$ROOT/deploy/kind/kind-config.yaml" --wait 300s
  fi
}
if ! cluster_exists; then
  log "creating kind cluster $KIND_CLUSTER ${KIND_NODE_IMAGE:+from $KIND_NODE_IMAGE}"
  timed cluster-create create_cluster
fi

if [[ "${SKIP_BUILD:-0}" != "1" ]]; then
  timed image-build "$ROOT/deploy/container/build-image.sh"
fi
# The release runs each image under a tag naming its content: a rebuilt image rolls the pods on upgrade (the
# tag alone, "<appVersion>-cpu", would leave the pod templates unchanged), and an image already on every node
# is not loaded again (this kind's check needs crictl, which a k8s-local node lacks: it would reload 1.5 GB).
content_tag() {
  local id
  id="$(docker image inspect -f '{{.Id}}' "$1" | sed 's/^sha256://' | cut -c1-12)"
  docker tag "$1" "$1-$id"
  echo "$1-$id"
}
on_every_node() {
  local ref="$1" node images
  if [[ "$ref" != */* ]]; then ref="docker.io/library/$ref"    # containerd's full reference
  elif [[ "${ref%%/*}" != *[.:]* ]]; then ref="docker.io/$ref"; fi
  for node in $(kind get nodes --name "$KIND_CLUSTER"); do
    # the list first: `ctr ... | grep -q` would fail under pipefail when grep stops reading early
    images="$(docker exec "$node" ctr -n k8s.io images ls -q 2>/dev/null || true)"
    grep -qxF "$ref" <<<"$images" || return 1
  done
}
RUN_IMAGE="$(content_tag "$IMAGE")"
RUN_REDIS="$(content_tag "$REDIS_IMAGE")"
# Older content tags of this build here (the layers stay while a tag uses them).
docker images --format '{{.Repository}}:{{.Tag}}' "${IMAGE%:*}" | grep -F "${IMAGE}-" | grep -vxF "$RUN_IMAGE" \
  | xargs -r docker rmi >/dev/null || true
missing=()
for img in "$RUN_IMAGE" "$RUN_REDIS"; do on_every_node "$img" || missing+=("$img"); done
if ((${#missing[@]})); then
  log "loading ${missing[*]}"
  timed kind-load kind load docker-image "${missing[@]}" --name "$KIND_CLUSTER"
else
  log "$RUN_IMAGE and $RUN_REDIS are on every node already"
fi

kubectl --context "$CTX" create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl --context "$CTX" apply -f - >/dev/null
sets=(--set image.repository="${RUN_IMAGE%:*}" --set image.tag="${RUN_IMAGE##*:}"
      --set redis.bundled.image.repository="${RUN_REDIS%:*}" --set redis.bundled.image.tag="${RUN_REDIS##*:}")
if ! cluster_has_dns; then
  log "kube-dns has no ready endpoint here: pods reach Services through service environment variables"
  sets+=(--set serviceAddresses=env)
fi
log "installing release $RELEASE into $NAMESPACE ($CTX, Kubernetes $(kubectl --context "$CTX" version -o json \
  | sed -n 's/.*"gitVersion": *"\([^"]*\)".*/\1/p' | tail -1))"
timed "install-$RELEASE" "$HELM" upgrade --install "$RELEASE" "$ROOT/deploy/helm/pdserve" \
  --kube-context "$CTX" --namespace "$NAMESPACE" -f "$ROOT/deploy/helm/values-kind.yaml" "${sets[@]}" "$@" \
  --wait --timeout 15m
kubectl --context "$CTX" -n "$NAMESPACE" get pods -l "app.kubernetes.io/instance=$RELEASE" -o wide >&2
log "ready: kubectl --context $CTX -n $NAMESPACE port-forward svc/${RELEASE}-router 50051:50051"
