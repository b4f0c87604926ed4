#!/usr/bin/env bash
# Kernel check on an NVIDIA GPU, in under 8 minutes:
#   1. every kernel test compiled for and run on the GPU (not Pallas interpret mode), against the
#      jnp references on the same GPU (tests/kernels with DEEPINFER_KERNELS_ON_DEVICE=1);
#   2. a micro-benchmark of each kernel against its reference: one table with time, TFLOP/s,
#      GB/s, fraction of the device peak, speedup and max difference
#      (python -m deepinfer.pallas_kernels.bench --sweep).
# Without an NVIDIA GPU it says so and exits 0.
#
#   benchmarks/device_check.sh            # from anywhere; PYTHON=... picks the interpreter
#
# Needs a Python with jax[cuda12]==0.12.0.1 (the project's `gpu` extra) and this package installed;
# default interpreter: .venv/bin/python of this checkout, else python3.
set -u
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "device_check: no NVIDIA GPU on this machine (nvidia-smi finds none); nothing to check."
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/device_check: GPU: /'

backend=$(JAX_PLATFORMS=cuda "$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null | tail -n 1)
if [ "$backend" != "gpu" ]; then
  echo "device_check: an NVIDIA GPU is present but '$PY' has no CUDA-enabled JAX"
  echo "device_check: install it with: $PY -m pip install 'jax[cuda12]==0.12.0.1' (the project's [gpu] extra)"
  exit 1
fi

export JAX_PLATFORMS=cuda
export XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
start=$(date +%s)

echo
echo "== kernel tests on the GPU (compiled Pallas-Triton vs jnp reference) =="
DEEPINFER_KERNELS_ON_DEVICE=1 JAX_DEFAULT_MATMUL_PRECISION=highest \
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider \
    tests/kernels/test_sparse_attention_kernel.py tests/kernels/test_mhc_kernel.py tests/kernels/test_indexer_kernel.py \
    tests/kernels/test_matmul_kernels.py tests/kernels/test_compress_store_kernel.py -rs
rc=$?
if [ $rc -ne 0 ]; then echo "device_check: kernel tests FAILED (exit $rc; 124 = timed out)"; status=1; fi

echo
echo "== kernels in use on this device =="
"$PY" -c "
from deepinfer.pallas_kernels.registry import describe
for op, impl, why in describe():
    print(f'{op:<18} {impl:<11} {why}')
" || status=1

echo
echo "== micro-benchmark: kernel vs reference =="
timeout 150 "$PY" -m deepinfer.pallas_kernels.bench --sweep --iters 20
rc=$?
if [ $rc -ne 0 ]; then echo "device_check: benchmark had failures (exit $rc; 124 = timed out)"; status=1; fi

echo
echo "device_check: done in $(( $(date +%s) - start )) s, status $status"
exit $status
