# kvstore node image. Build from the repository root: `docker compose build`. Debian 12 (bookworm),
# pinned: plain python:3.11-slim follows Debian's newest release.
# The entry point is the `kvstore-server` console script, the same one the tests start;
# `kvstore` (the admin CLI) is in the image too and serves as the health check.

# The build stage compiles the C core (kvstore_native: a C compiler and Python's headers, which
# this image has, are all it needs) and turns everything into wheels; the image installs only those.
FROM python:3.11-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY clients/python /src/clients/python
COPY native /src/native
COPY pyproject.toml README.md /src/
COPY kvstore /src/kvstore
RUN pip wheel --no-cache-dir --wheel-dir /wheels "./clients/python[cluster]" ./native "./[cluster]"

FROM python:3.11-slim-bookworm

RUN groupadd --system --gid 990 kvstore \
 && useradd --system --uid 990 --gid kvstore --no-create-home --shell /usr/sbin/nologin kvstore

COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "kvstore-client[cluster]" kvstore-native "kvstore[cluster]" \
 && rm -rf /wheels \
 && python -c "import kvstore_native"

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
