# pdserve: ONE image for every role (`pdserve serve --role router|prefill|decode|colocated`).
# No model is baked in: mount one (PVC / hostPath / volume) or let `pdserve model init` write a random preset.
# Needs BuildKit (the default builder of Docker Engine >= 23; DOCKER_BUILDKIT=1 on Docker 20.10).
#
#   docker build -t pdserve:0.1.0-cpu .                                   # CPU image (kind, CI, laptops)
#   docker build --build-arg VARIANT=cuda -t pdserve:0.1.0-cuda .         # CUDA image (GPU nodes)
#
# Build arguments (docs/deploy.md#the-image):
#   CPU_BASE / CUDA_BASE  runtime base image of each variant (pinned tags; any image with python3 >= 3.11
#                         and its venv module, or an apt-based one where the build installs them)
#   TORCH_INDEX_URL       package index torch comes from (default: the PyTorch index of the variant)
#   TORCH_SPEC            torch requirement (default torch==2.13.0)
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL   index for every other package (default PyPI)
# Behind a TLS-intercepting proxy give pip the proxy's CA bundle as a build secret (never stored in a layer):
#   docker build --secret id=pip_cert,src=/etc/ssl/certs/ca-certificates.crt ...
#
# Stages: base-<variant> (OS + python3) -> deps (venv: torch, then the dependencies in pyproject.toml)
#         -> wheel (the pdserve wheel from the source tree) -> runtime (base + venv + wheel, non-root).
# Layers are ordered so that a source change rebuilds only the wheel and the last, small runtime layer.

ARG VARIANT=cpu
ARG CPU_BASE=python:3.11-slim-bookworm
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- runtime bases ---------------------------------------------------------------------------------
FROM ${CPU_BASE} AS base-cpu
# Bases without python3's venv module (an apt-based OS image) get it here; python images have it.
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/*; fi

FROM ${CUDA_BASE} AS base-cuda
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# ---- deps: a self-contained virtualenv in /opt/venv ---------------------------------------------------
FROM base-${VARIANT} AS deps
ARG VARIANT
ARG TORCH_INDEX_URL=""
ARG TORCH_SPEC=torch==2.13.0
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, on its own layer: the largest download, and it changes least often.
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
 && index="${TORCH_INDEX_URL}" \
 && if [ -z "$index" ]; then case "$VARIANT" in \
      cpu) index=https://download.pytorch.org/whl/cpu ;; \
      cuda) index=https://download.pytorch.org/whl/cu128 ;; \
      *) echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 2 ;; esac; fi \
 && pip install --index-url "$index" "${TORCH_SPEC}"
# Then the dependencies pyproject.toml names (plus the nixl extra and the Kubernetes client the router's
# k8s discovery uses), read from pyproject.toml alone so that source changes keep this layer cached.
COPY pyproject.toml /src/pyproject.toml
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
 && python3 -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; \
extra = p['optional-dependencies']; \
print('\n'.join(p['dependencies'] + extra['nixl'] + [r for r in extra['cluster'] if r.startswith('kubernetes')]))" \
    > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt \
 && pip check \
 && rm -rf /opt/venv/lib/python3*/site-packages/nixl_ep_cu*
# (nixl's wheel also carries nixl_ep, its expert-parallel all-to-all library, ~105 MB: not imported by
# nixl itself nor by pdserve.)

# ---- wheel: pdserve itself ------------------------------------------------------------------------------
FROM deps AS wheel
COPY . /src
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /wheels /src

# ---- runtime ------------------------------------------------------------------------------------------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="pdserve" \
      org.opencontainers.image.description="Disaggregated prefill/decode LLM serving (${VARIANT})" \
      org.opencontainers.image.source="https://github.com/pdserve/pdserve" \
      org.opencontainers.image.licenses="Apache-2.0"
# tini as PID 1: it forwards SIGTERM to pdserve (which drains) and reaps the processes that health checks
# and `docker exec` leave behind when they are killed on a timeout (pdserve does not reap children).
# uid/gid 10001 = podSecurityContext.runAsUser in the chart. /models is owned by it so that a fresh Docker
# volume mounted there is writable by that user (Docker copies the mount point's owner into a new volume).
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && groupadd --system --gid 10001 pdserve \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/pdserve --create-home \
      --shell /usr/sbin/nologin pdserve \
 && install -d -o 10001 -g 10001 /models
COPY --from=deps /opt/venv /opt/venv
COPY deploy/container/pdserve-healthcheck /opt/venv/bin/pdserve-healthcheck
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/pdserve
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    pip install --no-deps --no-index /wheels/*.whl \
 && pdserve --version
WORKDIR /home/pdserve
USER 10001:10001
# gRPC (every role), KV side channel / TCP data (workers), Prometheus metrics.
EXPOSE 50051 50052 9090
# grpc.health.v1 overall status on $PDSERVE_PORT (default 50051); SERVING once the model is loaded and the
# KV transport is up, NOT_SERVING while draining. Timings follow the chart's startup and liveness probes.
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=6 CMD ["pdserve-healthcheck"]
ENTRYPOINT ["tini", "--", "pdserve"]
CMD ["--help"]
