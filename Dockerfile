# syntax=docker/dockerfile:1
# pdserve: ONE image for every role (`pdserve serve --role router|prefill|decode|colocated`).
# No model is baked in: mount one (PVC / hostPath) or let the chart's init container write a random preset.
#
#   docker build --build-arg VARIANT=cpu  -t pdserve:0.1.0-cpu  .   # slim CPU image (kind, CI)
#   docker build --build-arg VARIANT=cuda -t pdserve:0.1.0-cuda .   # CUDA image (GPU nodes, NIXL/UCX)
#
# Stages: base-cpu / base-cuda (runtime OS + Python) -> build (venv with torch + pdserve) -> runtime.
# Base images are pinned by tag; never "latest".

ARG VARIANT=cpu
ARG CPU_BASE=python:3.11-slim-bookworm
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- runtime bases ---------------------------------------------------------------------------------
FROM ${CPU_BASE} AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${CUDA_BASE} AS base-cuda
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

# ---- build: a self-contained virtualenv in /opt/venv --------------------------------------------------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS build
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --upgrade pip \
 && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kvtransfer ./kvtransfer
COPY prefill_service ./prefill_service
COPY decode_service ./decode_service
COPY router ./router
COPY pdserve ./pdserve
# nixl: NIXL + UCX for KV over RDMA (simulated RDMA with UCX_TLS=tcp on CPU); kubernetes: router discovery.
RUN pip install ".[nixl]" "kubernetes>=29" \
 && pdserve --version

# ---- runtime ------------------------------------------------------------------------------------------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="pdserve" \
      org.opencontainers.image.description="Disaggregated prefill/decode LLM serving (${VARIANT})" \
      org.opencontainers.image.source="https://github.com/pdserve/pdserve" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/venv /opt/venv
RUN groupadd --system --gid 10001 pdserve \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/pdserve --create-home --shell /usr/sbin/nologin pdserve
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/pdserve
WORKDIR /home/pdserve
USER 10001:10001
# gRPC (every role), KV side channel / TCP data (workers), Prometheus metrics.
EXPOSE 50051 50052 9090
ENTRYPOINT ["pdserve"]
CMD ["--help"]
