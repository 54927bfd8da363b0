# pdserve: ONE image for every role (`pdserve serve --role router|prefill|decode|colocated`).
# No model is baked in: mount one (PVC / hostPath / volume) or let `pdserve model init` write a random preset.
# Needs BuildKit (the default builder of Docker Engine >= 23; DOCKER_BUILDKIT=1 on Docker 20.10).
#
#   docker build -t pdserve:0.1.0-cpu .                                   # CPU image (kind, CI, laptops)
#   docker build --build-arg VARIANT=cuda -t pdserve:0.1.0-cuda .         # CUDA image (GPU nodes)
#
# Build arguments (docs/deploy.md#the-image):
#   CPU_BASE / CUDA_BASE  runtime base image of each variant (pinned tags; any image with python3 and its
#                         venv module, or an apt-based one where the build installs them; the Python must
#                         be the lock's: 3.11 for cpu, 3.12 for cuda)
#   TORCH_INDEX_URL       extra package index holding the lock's torch build (cpu default: PyTorch's CPU
#                         index; cuda: none, PyPI's torch is the CUDA build)
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL   index for every other package (default PyPI)
# Every Python package is the lock's (locks/image-<variant>.txt: exact versions and sha256 hashes, written
# by `make lock`); pip refuses anything else, so the same build gives the same bytes in six months.
# Behind a TLS-intercepting proxy give pip the proxy's CA bundle as a build secret (never stored in a layer):
#   docker build --secret id=pip_cert,src=/etc/ssl/certs/ca-certificates.crt ...
#
# Stages: base-<variant> (OS + python3) -> lock (the variant's lock, and its torch entry alone) -> deps
#         (venv: torch, then the rest of the lock) -> wheel (the pdserve wheel from the source tree)
#         -> runtime (base + venv + wheel, non-root).
# Layers are ordered so that a source change rebuilds only the wheel and the last, small runtime layer,
# and a lock refresh that keeps torch's pin keeps the torch layer.

ARG VARIANT=cpu
ARG CPU_BASE=python:3.11-slim-bookworm
# PyPI's torch 2.13.0 is the CUDA 13 build and carries the CUDA libraries as wheels (cuda-toolkit,
# nvidia-*), so the CUDA base needs only python3; the node needs an NVIDIA driver for CUDA 13 (>= 580).
ARG CUDA_BASE=nvidia/cuda:13.0.0-base-ubuntu24.04

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

# ---- lock: the variant's lock, and torch's entry of it on its own ------------------------------------
# COPY --from of torch.txt is cached by its content: a lock refresh that keeps torch keeps the torch layer.
FROM base-${VARIANT} AS lock
ARG VARIANT
COPY locks/image-${VARIANT}.txt /lock/all.txt
RUN awk '/^torch==/ {keep = 1; print; next} keep && /^ / {print; next} {keep = 0}' /lock/all.txt \
      > /lock/torch.txt \
 && grep -q '^torch==' /lock/torch.txt

# ---- deps: a self-contained virtualenv in /opt/venv, exactly the lock ------------------------------------
FROM base-${VARIANT} AS deps
ARG VARIANT
ARG TORCH_INDEX_URL=""
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, on its own layer: the largest download, and it changes least often.
COPY --from=lock /lock/torch.txt /tmp/lock/torch.txt
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
 && index="${TORCH_INDEX_URL}" \
 && if [ -z "$index" ]; then case "$VARIANT" in \
      cpu) index=https://download.pytorch.org/whl/cpu ;; \
      cuda) index="" ;; \
      *) echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 2 ;; esac; fi \
 && pip install --require-hashes --no-deps ${index:+--extra-index-url "$index"} -r /tmp/lock/torch.txt
# Then the rest of the lock (pip itself and setuptools, which the wheel stage builds with, included).
COPY --from=lock /lock/all.txt /tmp/lock/all.txt
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
 && pip install --require-hashes --no-deps -r /tmp/lock/all.txt \
 && rm -r /tmp/lock \
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
