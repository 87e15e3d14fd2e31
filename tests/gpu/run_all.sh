#!/usr/bin/env bash
# chorus's GPU tests: every tests/gpu/test_*.py file, then chorus.cuda's CPU-side tests
# (kernels under Triton's interpreter), one pytest run per file, for the multi-GPU machine:
#
#     bash tests/gpu/run_all.sh          logs in $OUT (else ./gpu-test-logs), one per file
#                                        (and, with CHORUS_LOGS_TAR=FILE, all of them in one .tgz)
#
# CHORUS_GPU_FILES="tests/gpu/test_cuda_component.py interpreter" runs only the files
# named (and "interpreter": the CPU-side tests), so that two runs of under 10 minutes each
# cover everything.
#
# Every run is bounded twice: each test by pytest-timeout when it is installed
# (--timeout=$PER_TEST_S), each file by `timeout`, which kills the file's whole process
# group (pytest and the ranks it spawned); whatever of that group is left when pytest
# returns is killed too.  The whole run stays within CHORUS_GPU_BUDGET_S seconds (570): a
# file gets at most what is left, and a file reached after the budget is spent is
# reported NOT RUN.  Prints one line per file (PASS, FAIL, TIMEOUT, SKIPPED: nothing ran,
# NOT RUN), and exits non-zero unless every file passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0  # never NVLink multicast
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LOGS="${OUT:-$PWD/gpu-test-logs}"
mkdir -p "$LOGS"
BUDGET="${CHORUS_GPU_BUDGET_S:-570}"
PER_TEST_S="${CHORUS_GPU_TEST_TIMEOUT_S:-180}"
START=$(date +%s)
PER_TEST=()
python -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout="$PER_TEST_S")

{
  python - <<'PY'
import sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| gpus", torch.cuda.device_count(), *{torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
for name, module in (("triton", "triton"), ("cuda-bindings", "cuda.bindings"), ("pytest-timeout", "pytest_timeout")):
    try:
        mod = __import__(module, fromlist=["_"])
        print(name, getattr(mod, "__version__", "?"))
    except ImportError as e:
        print(name, "missing:", e)
PY
  nvidia-smi topo -m 2>/dev/null || true
} >"$LOGS/versions.log" 2>&1
head -1 "$LOGS/versions.log"
[ ${#PER_TEST[@]} -eq 0 ] && echo "(pytest-timeout missing: each file is bounded by timeout only)"

FAILED=0

# run_file NAME LOG CAP_S [VAR=VALUE...] -- PYTEST_ARGS...
run_file() {
  local name=$1 log="$LOGS/$2.log" cap=$3
  shift 3
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -le 15 ]; then
    printf '%-8s %-40s under 15 s of the %s s budget left\n' "NOT RUN" "$name" "$BUDGET"
    FAILED=1
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  local t0
  t0=$(date +%s)
  # -o addopts: one process (the GPU tests share the GPUs; the GPU machine has no pytest-xdist)
  env ${envs[@]+"${envs[@]}"} timeout -k 15 "$cap" python -m pytest -o addopts=-q "$@" -rs -p no:cacheprovider \
      ${PER_TEST[@]+"${PER_TEST[@]}"} >"$log" 2>&1 &
  local pid=$!
  wait "$pid"
  local rc=$?
  kill -9 -- "-$pid" 2>/dev/null  # timeout's process group: ranks left behind by pytest
  local secs=$(($(date +%s) - t0))
  local verdict=FAIL
  case $rc in
    0) verdict=PASS ;;
    124|137) verdict=TIMEOUT ;;
    5) verdict=SKIPPED ;;  # nothing ran (a module-level skip: the reason is on the line)
  esac
  [ "$rc" -ne 0 ] && FAILED=1
  local summary
  summary=$(grep -E "^=*ERROR|[0-9]+ (passed|failed|skipped|errors?|xfailed|deselected)|no tests ran" "$log" \
            | tail -1 | tr -d '=' | xargs)
  local skipped
  skipped=$(grep -m1 -E "^SKIPPED \[" "$log" | sed -E 's/^SKIPPED \[[0-9]+\] [^ ]+ //')
  printf '%-8s %-40s %4ss  %s%s  [%s]\n' "$verdict" "$name" "$secs" "${summary:-no pytest summary}" \
      "${skipped:+ (skipped: $skipped)}" "$log"
  {
    echo "== run_all.sh: exit status $rc after ${secs}s (cap ${cap}s); GPU processes now:"
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>&1 || true
  } >>"$log"
}

# name, cap in seconds (most informative first; the caps add up to more than the budget,
# which only a run that hangs everywhere would reach)
declare -A CAPS=(
  [tests/gpu/test_cuda_component.py]=360  # (14 of its tests took 271 s on 4 H200s)
  [tests/gpu/test_cuda_failures_gpu.py]=150
  [tests/gpu/test_fsdp_cuda.py]=120
  [tests/gpu/test_cuda_hosts.py]=120
  [tests/gpu/test_api_cuda.py]=180
  [tests/gpu/test_torch_backend_cuda.py]=120
)
ORDER=(tests/gpu/test_cuda_component.py tests/gpu/test_cuda_failures_gpu.py tests/gpu/test_fsdp_cuda.py
       tests/gpu/test_cuda_hosts.py tests/gpu/test_api_cuda.py tests/gpu/test_torch_backend_cuda.py)
for f in tests/gpu/test_*.py; do  # files added later run too, after these
  [[ " ${ORDER[*]} " == *" $f "* ]] || ORDER+=("$f")
done
wanted() { [ -z "${CHORUS_GPU_FILES:-}" ] || [[ " $CHORUS_GPU_FILES " == *" $1 "* ]]; }
for name in ${CHORUS_GPU_FILES:-}; do  # a name that matches nothing would make a run of nothing look passed
  if [ "$name" != interpreter ] && [[ " ${ORDER[*]} " != *" $name "* ]]; then
    printf '%-8s %-40s not a GPU test file (CHORUS_GPU_FILES)\n' "UNKNOWN" "$name"
    FAILED=1
  fi
done
for f in "${ORDER[@]}"; do
  [ -f "$f" ] && wanted "$f" || continue
  run_file "$f" "$(basename "$f" .py)" "${CAPS[$f]:-120}" -- "$f"
done
wanted interpreter || { echo "total $(($(date +%s) - START))s; logs in $LOGS"; exit "$FAILED"; }
# the CPU-side tests of the same code, in a process of their own (TRITON_INTERPRET must
# never reach the GPU tests' processes).  Triton's interpreter before 3.7 turns scalar
# arguments into 1-element arrays and reads loop bounds with int(), which NumPy 2.4
# refuses; there these tests are CI's alone.
if python - <<'PY'
import sys
import numpy, triton
old = tuple(map(int, triton.__version__.split(".")[:2])) < (3, 7)
new_np = tuple(map(int, numpy.__version__.split(".")[:2])) >= (2, 4)
sys.exit(0 if old and new_np else 1)
PY
then
  printf '%-8s %-40s Triton %s'"'"'s interpreter cannot run with NumPy %s (CI runs these)\n' "SKIPPED" \
      "tests/test_cuda_*.py" "$(python -c 'import triton; print(triton.__version__)')" \
      "$(python -c 'import numpy; print(numpy.__version__)')"
else
  run_file "tests/test_cuda_*.py" cpu-interpreter 150 TRITON_INTERPRET=1 -- \
      tests/test_cuda_kernels.py tests/test_cuda_algorithms.py tests/test_cuda_failures.py tests/test_cuda_staging.py
fi

echo "total $(($(date +%s) - START))s; logs in $LOGS"
# CHORUS_LOGS_TAR=FILE: every log also in one gzipped tar (for a runner that returns few files)
if [ -n "${CHORUS_LOGS_TAR:-}" ]; then
  packed=$(mktemp) && tar czf "$packed" -C "$LOGS" --exclude "$(basename "$CHORUS_LOGS_TAR")" . \
      && mv "$packed" "$CHORUS_LOGS_TAR" && echo "logs in $CHORUS_LOGS_TAR"
fi
exit "$FAILED"
