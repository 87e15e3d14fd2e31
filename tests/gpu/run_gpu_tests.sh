#!/usr/bin/env bash
# chorus.cuda's GPU tests (tests/gpu), for the multi-GPU machine:
#     bash tests/gpu/run_gpu_tests.sh            (from the repository root)
# Prints the versions it runs with; writes the whole log to $OUT/gpu-tests.log when
# $OUT is set.  Every test has a time limit (pytest-timeout when installed; the whole
# run is bounded by `timeout` either way).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0  # never NVLink multicast
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LOG="${OUT:+$OUT/gpu-tests.log}"
LOG="${LOG:-/dev/null}"
{
  echo "== versions"
  python - <<'PY'
import sys
import torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i}", torch.cuda.get_device_name(i))
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
try:
    from cuda import bindings
    print("cuda-bindings", getattr(bindings, "__version__", "?"))
except ImportError as e:
    print("cuda-bindings missing:", e)
PY
  nvidia-smi topo -m 2>/dev/null || true
  per_test=()
  python -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=900)
  echo "== pytest tests/gpu ${per_test[*]}"
  timeout 3000 python -m pytest tests/gpu -x -q -rs "${per_test[@]}" -p no:cacheprovider
  rc=$?
  echo "== exit status $rc"
  # the CPU-side tests of the same code (kernels under Triton's interpreter: a separate
  # process, so that TRITON_INTERPRET never reaches the GPU tests' children)
  echo "== pytest chorus.cuda CPU tests"
  TRITON_INTERPRET=1 timeout 900 python -m pytest tests/test_cuda_kernels.py tests/test_cuda_algorithms.py tests/test_cuda_failures.py \
      tests/test_cuda_staging.py -x -q -rs "${per_test[@]}" -p no:cacheprovider
  cpu=$?
  echo "== exit status $cpu"
  [ "$rc" -eq 0 ] && rc=$cpu
  exit "$rc"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
