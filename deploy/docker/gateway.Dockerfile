# syntax=docker/dockerfile:1.7
# infermesh gateway. Build from the repository root (BuildKit reads gateway.Dockerfile.dockerignore):
#   docker build -f deploy/docker/gateway.Dockerfile -t infermesh/gateway:0.1.0 .
# Runs as uid 10001 and writes nothing outside /tmp, so it runs with a read-only root filesystem.

FROM python:3.11.13-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
# Only the gateway's own dependency set (no torch, numba or numpy; no test or dev tools).
COPY requirements/gateway.txt requirements.txt
RUN pip install --no-cache-dir -r requirements.txt
# grpcio-tools only generates the stubs: it lives in a venv the final stage does not copy.
RUN python -m venv /opt/protoc && /opt/protoc/bin/pip install --no-cache-dir grpcio-tools==1.85.1
COPY protos/ protos/
RUN mkdir -p gen/python \
 && /opt/protoc/bin/python -m grpc_tools.protoc -Iprotos --python_out=gen/python --pyi_out=gen/python --grpc_python_out=gen/python protos/infermesh/v1/*.proto protos/inference/*.proto
COPY services/ services/
# The dev CA, for compose's one-shot tls-init (deploy/compose.yaml); the gateway itself never runs it.
COPY tools/__init__.py tools/dev_ca.py tools/
COPY deploy/docker/healthcheck.py healthcheck.py
# Byte-compile now: at run time the root filesystem is read-only.
RUN python -m compileall -q services tools gen/python healthcheck.py

FROM python:3.11.13-slim-bookworm
LABEL org.opencontainers.image.title="infermesh-gateway" \
      org.opencontainers.image.description="infermesh edge: auth, quotas, deadlines, retries, shedding, routing"
RUN groupadd --system --gid 10001 infermesh \
 && useradd --system --uid 10001 --gid infermesh --home-dir /tmp --no-create-home --shell /usr/sbin/nologin infermesh
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
WORKDIR /app
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app:/app/gen/python \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    INFERMESH_GATEWAY_HOST=0.0.0.0 \
    INFERMESH_GATEWAY_PORT=50051 \
    INFERMESH_GATEWAY_METRICS_PORT=9101
# 50051: gRPC (infermesh.v1.Inference + grpc.health.v1); 9101: Prometheus /metrics.
EXPOSE 50051 9101
USER 10001:10001
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 CMD ["python", "/app/healthcheck.py", "gateway"]
# SIGTERM (the default stop signal) starts the drain; see docs/operations.md.
ENTRYPOINT ["python", "-m", "services.gateway"]
