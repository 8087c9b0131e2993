#!/usr/bin/env bash
# The GPU rows of docs/benchmarks.md and the CUDA tests, in one run on a CUDA machine.
#
# Runs from the repository root without installing layertap: the package
# layout the editable install maps (client/ is `layertap`, server/ is
# `layertap.server`) is linked into a temporary folder on PYTHONPATH.
# Packages the machine lacks come from WHEELS (pip download them for its
# Python; see docs/benchmarks.md), installed into a folder of their own.
# Every step's output goes to stdout and, when OUT is set, to $OUT/gpu.log.
#
#   bash benchmarks/gpu_checks.sh            # everything
#   STEPS="tests generate" bash benchmarks/gpu_checks.sh
set -u
WHEELS=${WHEELS:-.whl}
STEPS=${STEPS:-"tests compiled overhead generate"}
log=${OUT:-/tmp}/gpu.log
site=$(mktemp -d)
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHEELS"/*.whl || exit 1
fi
tree=$(mktemp -d)
mkdir "$tree/layertap"
ln -s "$PWD"/client/* "$tree/layertap/"
ln -s "$PWD/server" "$tree/layertap/server"
export PYTHONPATH="$tree:$site:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}

step() {  # step NAME SECONDS COMMAND...: one bounded step, logged
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" | tee -a "$log"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$log"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, grpc; print('torch', torch.__version__, torch.cuda.get_device_name(),
'| transformers', transformers.__version__, '| grpcio', grpc.__version__)"
  lscpu | grep -m1 'Model name'; nproc; } 2>&1 | tee -a "$log"

for s in $STEPS; do
  case $s in
    tests) step "CUDA tests" 150 python3 -m pytest -q -p no:cacheprovider -o addopts= \
             tests/server/reducers/test_no_sync.py tests/server/reducers/test_tap_op_cuda.py tests/e2e/test_generate.py tests/e2e/test_sequence_stats.py ;;
    # Issue 29: in-graph tap statistics on CUDA, with CUDA graphs (reduce-overhead); when this passes,
    # set compile.modes.CUDA_GRAPHS_VERIFIED. Then the compiled-serving module figures on the GPU.
    compiled) step "compiled taps on CUDA" 300 python3 -m pytest -q -p no:cacheprovider -o addopts= \
             tests/server/compile/test_compiled_cuda.py
              step "compiled_serving.py module-level (CUDA)" 240 python3 benchmarks/compiled_serving.py \
             --only module --device cuda --rounds 3 ;;
    overhead) step "overhead.py ResNet-50 bf16" 170 python3 benchmarks/overhead.py --model resnet50 \
             --dtype bfloat16 --batch 64 --device cuda --channels-last --steps 10 --repeats 3 ;;
    generate) step "generate.py" 170 python3 benchmarks/generate.py --device cuda --rounds 3 ;;
  esac
done
