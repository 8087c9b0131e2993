# layertap server image.
#   CPU (default):  docker build -t layertap .
#   CUDA:           docker build --build-arg BASE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04 \
#                       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 -t layertap:cuda .
# The image runs `layertap serve` on the built-in demo model; mount a model and
# pass --model to serve your own. It binds 0.0.0.0 inside the container only
# because a container's loopback is unreachable from outside it.
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

# CUDA bases ship without Python; slim bases already have it.
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/layertap
ENV PATH=/opt/layertap/bin:$PATH

RUN pip install --index-url ${TORCH_INDEX} "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY setup.py ./
COPY proto ./proto
COPY client ./client
COPY server ./server
RUN pip install ".[server]" && rm -rf /src

RUN useradd --system --uid 10001 layertap
USER layertap
WORKDIR /home/layertap

EXPOSE 50051 9466
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
    CMD python -c "import grpc,sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; \
s=g.HealthStub(grpc.insecure_channel('127.0.0.1:50051')).Check(h.HealthCheckRequest(), timeout=2); \
sys.exit(0 if s.status == h.HealthCheckResponse.SERVING else 1)"

# Protected mode: a server on 0.0.0.0 refuses to start without --auth-tokens and
# --tls-cert/--tls-key, or an explicit --insecure (local use; see docs/security.md).
ENTRYPOINT ["layertap", "serve", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9466"]
CMD []
