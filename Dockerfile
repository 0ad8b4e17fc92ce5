# kvstore node image. Build from the repository root: `docker compose build`.
# The entry point is the `kvstore-server` console script, the same one the tests start;
# `kvstore` (the admin CLI) is in the image too and serves as the health check.
FROM python:3.11-slim

RUN groupadd --system --gid 990 kvstore \
 && useradd --system --uid 990 --gid kvstore --no-create-home --shell /usr/sbin/nologin kvstore

WORKDIR /src
COPY clients/python /src/clients/python
COPY pyproject.toml README.md /src/
COPY kvstore /src/kvstore
RUN pip install --no-cache-dir "./clients/python[cluster]" "./[cluster]" && rm -rf /src
WORKDIR /

# The RDMA data plane (experimental, deploy/RDMA.md) needs pyverbs and a verbs provider from
# the distribution: `docker compose build --build-arg WITH_RDMA=1`.
ARG WITH_RDMA=0
RUN if [ "$WITH_RDMA" = 1 ]; then \
      apt-get update && apt-get install -y --no-install-recommends python3-pyverbs rdma-core ibverbs-providers \
      && rm -rf /var/lib/apt/lists/*; \
    fi

COPY deploy/docker/kvstore.toml /etc/kvstore/kvstore.toml
RUN mkdir -p /run/kvstore /var/lib/kvstore/nvme \
 && chown kvstore:kvstore /run/kvstore /var/lib/kvstore/nvme
USER kvstore

EXPOSE 50051 9452
VOLUME ["/var/lib/kvstore/nvme"]
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["kvstore", "--target", "127.0.0.1:50051", "--timeout", "3", "health"]
ENTRYPOINT ["kvstore-server"]
CMD ["--config", "/etc/kvstore/kvstore.toml"]
