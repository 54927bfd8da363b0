# Shared by the kind lane's scripts (sourced, not run): which cluster and tools the lane uses.
#
# Two kinds of machine:
#   * stock kind (a laptop): `kind` and `kubectl` on PATH, the node image pulled by kind; the lane makes its
#     own cluster KIND_CLUSTER=pdserve-e2e from kind-config.yaml (a control plane and two workers).
#   * a k8s-local machine (/work/shared/k8s-local/setup.sh: no registry, Kubernetes 1.20 built from Debian's
#     sources, node image kp/node:v1.20.2 assembled locally): its kind, kubectl and kubeconfig under
#     K8S_LOCAL_DIR, its cluster `kp` reused as it is, or made again from the local node image (one node:
#     that image's CNI is a static bridge per node).
# Sets ROOT, STATE, KIND_CLUSTER, KIND_NODE_IMAGE (empty: kind's own), NAMESPACE, RELEASE, HELM, IMAGE,
# REDIS_IMAGE; exports PATH and KUBECONFIG for the tools and the tests.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STATE="${PDSERVE_KIND_STATE:-$ROOT/.run/kind-lane}"
mkdir -p "$STATE"
K8S_LOCAL_DIR="${K8S_LOCAL_DIR:-/var/tmp/k8s-local}"
if [[ -x "$K8S_LOCAL_DIR/kindpkg/usr/bin/kind" && "${KIND_CLUSTER:-kp}" == kp ]]; then
  export PATH="$K8S_LOCAL_DIR/kindpkg/usr/bin:$K8S_LOCAL_DIR/bin:$PATH"
  export KUBECONFIG="${KUBECONFIG:-$K8S_LOCAL_DIR/kubeconfig}"
  KIND_CLUSTER=kp
  KIND_NODE_IMAGE="${KIND_NODE_IMAGE:-kp/node:v1.20.2}"
fi
export KIND_CLUSTER="${KIND_CLUSTER:-pdserve-e2e}"
KIND_NODE_IMAGE="${KIND_NODE_IMAGE:-}"
export NAMESPACE="${NAMESPACE:-pdserve-e2e}"
export RELEASE="${RELEASE:-pdserve}"
export HELM="${HELM:-$ROOT/.tools/node_modules/.bin/helm}"
APP_VERSION="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$ROOT/deploy/helm/pdserve/Chart.yaml")"
export IMAGE="${IMAGE:-pdserve:${APP_VERSION}-cpu}"
export REDIS_IMAGE="${REDIS_IMAGE:-pdserve-lane-redis:bookworm}"
CTX="kind-${KIND_CLUSTER}"

log() { printf '[kind-lane] %s\n' "$*" >&2; }

# timed NAME CMD...: run CMD, log its seconds and append {"step": NAME, "seconds": S} to $STATE/times.jsonl.
timed() {
  local name="$1" start end
  shift
  start=$(date +%s.%N)
  "$@"
  end=$(date +%s.%N)
  awk -v n="$name" -v a="$start" -v b="$end" \
    'BEGIN { printf "{\"step\": \"%s\", \"seconds\": %.1f}\n", n, b - a }' >>"$STATE/times.jsonl"
  log "$name: $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }') s"
}

# Why the lane cannot run here, or nothing: docker, kind, kubectl and helm must all work.
kind_unusable() {
  docker info >/dev/null 2>&1 || { echo "no usable Docker engine (docker info failed)"; return; }
  command -v kind >/dev/null || { echo "kind is not installed (docs/deploy.md#kind)"; return; }
  command -v kubectl >/dev/null || { echo "kubectl is not installed"; return; }
  [[ -x "$HELM" ]] || echo "helm not found at $HELM (make tools)"
}

cluster_exists() {
  local clusters
  clusters="$(kind get clusters 2>/dev/null || true)"
  grep -qxF "$KIND_CLUSTER" <<<"$clusters"
}

# A cluster kind lists may not answer: its node containers stop with the Docker engine that ran them (a
# machine's restart, a CI run after the session that made it). Start them again and wait for the API
# server (at most 180 s); prints why not when it still does not answer.
cluster_unreachable() {
  cluster_exists || return 0
  kubectl --context "$CTX" get --raw /readyz >/dev/null 2>&1 && return 0
  local node
  for node in $(kind get nodes --name "$KIND_CLUSTER" 2>/dev/null); do
    docker start "$node" >/dev/null 2>&1 || true
  done
  local deadline=$((SECONDS + 180))
  while ((SECONDS < deadline)); do
    kubectl --context "$CTX" get --raw /readyz >/dev/null 2>&1 && return 0
    sleep 3
  done
  echo "cluster $KIND_CLUSTER exists but its API server does not answer (node containers restarted, 180 s)"
}

# The cluster has in-cluster DNS when kube-dns has a ready endpoint (k8s-local nodes have no CoreDNS).
cluster_has_dns() {
  [[ -n "$(kubectl --context "$CTX" -n kube-system get endpoints kube-dns \
           -o jsonpath='{.subsets[*].addresses[*].ip}' 2>/dev/null)" ]]
}
