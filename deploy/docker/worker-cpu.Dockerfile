# syntax=docker/dockerfile:1.7
# infermesh worker, CPU variant (kernels run as Numba CPU twins). Build from the repository root:
#   docker build -f deploy/docker/worker-cpu.Dockerfile -t infermesh/worker-cpu:0.1.0 .
# The demo models (digits/1, tinylm/1) are copied into /app/model_repo as shipped in the
# repository (docs/models.md); mount a real repository over
# INFERMESH_WORKER_MODEL_REPOSITORY to serve other models. Runs as uid 10001 with a read-only root
# filesystem: Numba's cache and every other write go under /tmp.

FROM python:3.11.13-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
# Only the worker's own dependency set (no test or dev tools, no scikit-learn).
COPY requirements/worker.txt requirements.txt
# The set pins torch==2.13.0; PyPI's wheel for that is a multi-GB CUDA build. The CPU build
# (2.13.0+cpu, from the PyTorch CPU index) satisfies the same pin, so install it first.
RUN pip install --no-cache-dir --no-deps --index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu \
 && pip install --no-cache-dir -r requirements.txt
# grpcio-tools only generates the stubs: it lives in a venv the final stage does not copy.
RUN python -m venv /opt/protoc && /opt/protoc/bin/pip install --no-cache-dir grpcio-tools==1.85.1
COPY protos/ protos/
RUN mkdir -p gen/python \
 && /opt/protoc/bin/python -m grpc_tools.protoc -Iprotos --python_out=gen/python --pyi_out=gen/python --grpc_python_out=gen/python protos/infermesh/v1/*.proto protos/inference/*.proto
COPY services/ services/
COPY kernels/ kernels/
# The demo models ship built in the repository (docs/models.md): nothing is trained here.
COPY model_repo/digits/ model_repo/digits/
COPY model_repo/tinylm/ model_repo/tinylm/
COPY deploy/docker/healthcheck.py healthcheck.py
ENV PYTHONPATH=/app:/app/gen/python NUMBA_CACHE_DIR=/tmp/numba-cache
RUN python -m compileall -q services kernels gen/python healthcheck.py

FROM python:3.11.13-slim-bookworm
LABEL org.opencontainers.image.title="infermesh-worker-cpu" \
      org.opencontainers.image.description="infermesh worker (CPU): model runtime, dials the scheduler's Attach stream"
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
    NUMBA_CACHE_DIR=/tmp/numba-cache \
    INFERMESH_WORKER_HOST=0.0.0.0 \
    INFERMESH_WORKER_PORT=50053 \
    INFERMESH_WORKER_METRICS_PORT=9103 \
    INFERMESH_WORKER_MODEL_REPOSITORY=/app/model_repo
# 50053: grpc.health.v1 only (nothing else dials a worker); 9103: Prometheus /metrics.
EXPOSE 50053 9103
USER 10001:10001
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 CMD ["python", "/app/healthcheck.py", "worker"]
# SIGTERM: stop taking work, finish what is running, detach; see docs/operations.md.
ENTRYPOINT ["python", "-m", "services.worker"]
