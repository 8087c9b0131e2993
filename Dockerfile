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
# g++: inductor compiles the reducers' statistics kernel to C++ on CPU (and
# Triton's launcher needs a C compiler on CUDA). Without it the server logs
# the failure once and uses the eager kernels (or pass --no-compile).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && if ! command -v python3 >/dev/null; then \
        apt-get install -y --no-install-recommends python3 python3-pip python3-venv python3-dev; \
    fi \
    && rm -rf /var/lib/apt/lists/* \
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

RUN useradd --system --uid 10001 layertap \
    && mkdir -p /var/lib/layertap/baselines && chown layertap /var/lib/layertap/baselines
# (A named volume mounted there starts as a copy of this directory, owned by layertap:
# otherwise Docker creates it root-owned and baselines could not be saved.)
USER layertap
WORKDIR /home/layertap
# Inductor's persistent cache: mount a volume here so a restarted container
# reuses its compiled kernels (seconds instead of tens of seconds).
ENV TORCHINDUCTOR_CACHE_DIR=/home/layertap/.cache/torchinductor
# Captum (Explain) imports matplotlib, which writes a font cache on first import:
# somewhere the layertap user can write, or it warns and uses a new temporary one.
ENV MPLCONFIGDIR=/tmp/matplotlib

EXPOSE 50051 9466
# The probe dials the plaintext, Health-only listener on the container's
# loopback (--health-address below), so it works when the main port speaks TLS.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
    CMD python -c "import grpc,sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; \
s=g.HealthStub(grpc.insecure_channel('127.0.0.1:50052')).Check(h.HealthCheckRequest(), timeout=2); \
sys.exit(0 if s.status == h.HealthCheckResponse.SERVING else 1)"

# Protected mode: a server on 0.0.0.0 refuses to start without --auth-tokens and
# --tls-cert/--tls-key, or an explicit --insecure (local use; see docs/security.md).
ENTRYPOINT ["layertap", "serve", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9466", \
            "--health-address", "127.0.0.1:50052"]
CMD []
