# Redis for the container lane: the chart's bundled-Redis StatefulSet runs it (redis.bundled.image), made
# from the same Debian base as the pdserve image because no registry image may be reachable.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/*
USER 999:999
ENTRYPOINT []
CMD ["redis-server"]
