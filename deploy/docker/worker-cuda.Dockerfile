# syntax=docker/dockerfile:1.7
# infermesh worker, CUDA variant (kernels run as Numba CUDA kernels on PyTorch's stream).
# Build from the repository root:
#   docker build -f deploy/docker/worker-cuda.Dockerfile -t infermesh/worker-cuda:0.1.0 .
# The CUDA user-space libraries come from wheels (torch's nvidia-* dependencies and numba-cuda's
# cuda-toolkit extra), so the base is the same slim Python image as the CPU variant; the node only
# needs the NVIDIA driver and container toolkit. The three pins below move together: a torch build
# for CUDA 12.8 (driver >= 570) and numba-cuda's CUDA 12 extra.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0+cu128
ARG NUMBA_CUDA_SPEC="numba-cuda[cu12]==0.30.4"

FROM python:3.11.13-slim-bookworm AS build
ARG TORCH_INDEX_URL
ARG TORCH_VERSION
ARG NUMBA_CUDA_SPEC
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY requirements/worker.txt requirements.txt
# torch's CUDA build with its nvidia-* runtime wheels first (it satisfies the set's torch==2.13.0),
# then the worker's dependency set (which re-pins what torch shares with it), then the CUDA target for Numba.
# DL3013 cannot see through the build args; both are exact == pins, set at the top of this file.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" --extra-index-url https://pypi.org/simple "torch==${TORCH_VERSION}" \
 && pip install --no-cache-dir -r requirements.txt \
 && pip install --no-cache-dir "${NUMBA_CUDA_SPEC}"
# grpcio-tools only generates the stubs: it lives in a venv the final stage does not copy.
RUN python -m venv /opt/protoc && /opt/protoc/bin/pip install --no-cache-dir grpcio-tools==1.85.1
COPY protos/ protos/
RUN mkdir -p gen/python \
 && /opt/protoc/bin/python -m grpc_tools.protoc -Iprotos --python_out=gen/python --pyi_out=gen/python --grpc_python_out=gen/python protos/infermesh/v1/*.proto protos/inference/*.proto
COPY services/ services/
COPY kernels/ kernels/
# The demo models ship built in the repository (docs/models.md), the same as the CPU image's.
COPY model_repo/digits/ model_repo/digits/
COPY model_repo/tinylm/ model_repo/tinylm/
COPY deploy/docker/healthcheck.py healthcheck.py
ENV PYTHONPATH=/app:/app/gen/python NUMBA_CACHE_DIR=/tmp/numba-cache
RUN python -m compileall -q services kernels gen/python healthcheck.py

FROM python:3.11.13-slim-bookworm
LABEL org.opencontainers.image.title="infermesh-worker-cuda" \
      org.opencontainers.image.description="infermesh worker (CUDA): model runtime, dials the scheduler's Attach stream"
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
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    INFERMESH_WORKER_HOST=0.0.0.0 \
    INFERMESH_WORKER_PORT=50053 \
    INFERMESH_WORKER_METRICS_PORT=9103 \
    INFERMESH_WORKER_MODEL_REPOSITORY=/app/model_repo
# 50053: grpc.health.v1 only (nothing else dials a worker); 9103: Prometheus /metrics.
EXPOSE 50053 9103
USER 10001:10001
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 CMD ["python", "/app/healthcheck.py", "worker"]
# SIGTERM: stop taking work, finish what is running, detach; see docs/operations.md.
ENTRYPOINT ["python", "-m", "services.worker"]
