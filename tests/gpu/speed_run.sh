#!/usr/bin/env bash
# chorus.cuda's speed run, for one multi-GPU host (all pairs NVLink), in about 540 s:
#
#     bash tests/gpu/speed_run.sh        logs and JSON in $OUT (else ./speed-logs)
#                                       (and, with CHORUS_LOGS_TAR=FILE, all of them in one .tgz)
#
# Parts (each in its own process group, bounded by `timeout` and by the bench's own
# --time-limit, its leftovers killed; a part that fails does not stop the next; a part
# reached with under 15 s of CHORUS_SPEED_BUDGET_S (540) left is NOT RUN):
#   1. smoke: all_reduce bf16/fp32, 8 B .. 64 MiB and odd counts, every algorithm and
#      the lane, bit for bit against NCCL on integer data (tests/gpu/speed_smoke.py)
#   2. all_reduce bf16, 4 B .. 1 GiB (x4): chorus, chorus's lane, NCCL, symm-mem 1/2-shot
#   3. calibrate: chorus's all_reduce by algorithm (the thresholds of
#      chorus/cuda/algorithms.py)
#   4. all_reduce 16 MiB .. 1 GiB on two simulated hosts (CHORUS_HOST_ID=a,a,b,b) through
#      chorus.cuda.rails' NCCL rails, against flat NCCL
#   5. a DDP step of a 100.7M-parameter model, chorus against NCCL (chorus bench-ddp --device cuda)
#   6. all_gather, reduce_scatter bf16, 1 KiB .. 256 MiB (x4); broadcast and all_to_all
#      bf16, 1 KiB .. 64 MiB (x8)
#   7. graph: all_reduce bf16, 4 B .. 4 MiB (x4), captured in a CUDA graph and replayed,
#      chorus against NCCL (chorus bench --graph)
#   8. unheld_all_reduce, unheld_all_gather, unheld_reduce_scatter: eager loops as they
#      come (chorus bench --unheld: the longer of CPU and GPU time per call), bf16,
#      all_reduce 8 B .. 2 MiB, the others 1 KiB .. 1 MiB (x4), against NCCL
#   9. lane: the CPU time of a small eager all_reduce by layer, the CUDA-graph replays
#      off and on alternating (tools/cuda_lane_cost.py; $LOGS/lane/lane-rank*.txt)
#  10. bound_all_reduce, bound_all_gather, bound_reduce_scatter: part 8's loops up to
#      256 KiB with each rank on the CPUs of its GPU (chorus bench --bind gpu)
#  11. bars: all_reduce 8 MiB .. 128 MiB (x2) against NCCL, three rounds of 300 calls
#  12. unheld_large_all_gather, unheld_large_reduce_scatter: part 8's loops at 16 .. 64 MiB (x2), where
#      both go to NCCL; unheld_all_to_all, unheld_broadcast: 1 KiB .. 16 MiB (x8), all on NCCL
#  13. handoff_from: all_reduce 4 MiB .. 32 MiB (x2) by chorus's two_shot_push, by chorus's
#      hand-off to NCCL, and by NCCL itself, three rounds (CHORUS_CUDA_NCCL_FROM_BYTES)
# Parts 8, 10, 11 and 12 run three rounds each (chorus bench --rounds 3: medians, and the
# range of NCCL's time over chorus's across the rounds).
# CHORUS_SPEED_PARTS="all_reduce graph ..." runs only the parts named (smoke, all_reduce,
# calibrate, rails, ddp, all_gather, reduce_scatter, broadcast, all_to_all, graph,
# unheld_all_reduce, unheld_all_gather, unheld_reduce_scatter, lane, bound_all_reduce,
# bound_all_gather, bound_reduce_scatter, bars, unheld_large_all_gather, unheld_large_reduce_scatter,
# unheld_all_to_all, unheld_broadcast, handoff_from).
# then a compact table per part: size, chorus us (GPU), chorus cpu us, nccl us, nccl/chorus,
# symm us, #wrong.  Exits non-zero unless every part passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0  # never NVLink multicast
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
LOGS="${OUT:-$PWD/speed-logs}"
mkdir -p "$LOGS"
BUDGET="${CHORUS_SPEED_BUDGET_S:-540}"
START=$(date +%s)
FAILED=0
PIDS=()

cleanup() {
  for pid in "${PIDS[@]}"; do kill -9 -- "-$pid" 2>/dev/null; done
}
trap cleanup EXIT

python - <<'PY' 2>&1 | tee "$LOGS/versions.log" | head -3
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| gpus", torch.cuda.device_count(), *{torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
try:
    import triton; print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
PY

# part NAME CAP_S CMD...: run CMD under timeout (its own process group), output to $LOGS/NAME.log
part() {
  local name=$1 cap=$2
  shift 2
  if [ -n "${CHORUS_SPEED_PARTS:-}" ] && [[ " $CHORUS_SPEED_PARTS " != *" $name "* ]]; then
    return
  fi
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -le 15 ]; then
    printf '%-8s %-28s under 15 s of the %s s budget left\n' "NOT RUN" "$name" "$BUDGET"
    FAILED=1
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  local t0
  t0=$(date +%s)
  timeout -k 10 "$cap" "$@" >"$LOGS/$name.log" 2>&1 &  # timeout leads a process group of its own
  local pid=$!
  PIDS+=("$pid")
  wait "$pid"
  local rc=$?
  kill -9 -- "-$pid" 2>/dev/null  # whatever of that group is left (ranks, compilers)
  local verdict=FAIL
  case $rc in
    0) verdict=PASS ;;
    124|137) verdict=TIMEOUT ;;
  esac
  [ "$rc" -ne 0 ] && FAILED=1
  printf '%-8s %-28s %4ss (cap %ss)  [%s]\n' "$verdict" "$name" "$(($(date +%s) - t0))" "$cap" "$LOGS/$name.log"
}

# bench NAME CAP_S ARGS...: chorus bench --device cuda with --time-limit CAP - 10, JSON to $LOGS/NAME.json
bench() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  [ "$cap" -gt "$left" ] && cap=$left
  [ "$cap" -lt 20 ] && cap=20  # (part reports NOT RUN when under 15 s are left)
  part "$name" "$cap" python -c "import sys; from chorus.cli import main; sys.exit(main())" bench --device cuda \
      --time-limit $((cap - 10)) --cuda-timeout 20 --json "$LOGS/$name.json" "$@"
}

part smoke 75 python tests/gpu/speed_smoke.py --max 64M --time-limit 65
[ -f "$LOGS/smoke.log" ] && grep -E "^ *(bfloat16|float32)|SMOKE|only" "$LOGS/smoke.log" | head -20

bench all_reduce 95 --collective all_reduce -b 4 -e 1G -f 4 -n 200 -w 20 --scale-iters --lane
bench calibrate 40 --collective all_reduce -b 256K -e 64M -f 2 -n 100 -w 10 --scale-iters --baseline none \
    --algorithm one_shot,two_shot_push,nccl
# two simulated hosts of two GPUs: chorus inside each, NCCL rails between (chorus.cuda.rails),
# against torch's flat NCCL group on the same 4 GPUs
CHORUS_HOST_ID=a,a,b,b CHORUS_CUDA_RAILS=nccl bench rails 40 --collective all_reduce -b 16M -e 1G -f 4 -n 50 -w 5 \
    --scale-iters
# a DDP step of a 100.7M-parameter MLP (4096-8192-8192-1), backend chorus against NCCL, 30 steps
part ddp 90 python -c "import sys; from chorus.cli import main; sys.exit(main())" bench-ddp --device cuda --world 4 \
    --features 4096 --hidden 8192 --batch 32 --steps 30 --json "$LOGS/ddp.json"
bench all_gather 35 --collective all_gather -b 1K -e 256M -f 4 -n 200 -w 20 --scale-iters
bench reduce_scatter 35 --collective reduce_scatter -b 1K -e 256M -f 4 -n 200 -w 20 --scale-iters
bench broadcast 30 --collective broadcast -b 1K -e 64M -f 8 -n 100 -w 10 --scale-iters
bench all_to_all 40 --collective all_to_all -b 1K -e 64M -f 8 -n 100 -w 10 --scale-iters
bench graph 40 --collective all_reduce -b 4 -e 4M -f 4 -n 200 -w 20 --graph --baseline nccl
NCCL_RUNTIME_CONNECT=0 bench unheld_all_reduce 90 --collective all_reduce -b 8 -e 2M -f 4 -n 300 -w 30 --unheld \
    --baseline all --rounds 3
for c in all_gather reduce_scatter; do
  NCCL_RUNTIME_CONNECT=0 bench "unheld_$c" 60 --collective "$c" -b 1K -e 1M -f 4 -n 300 -w 30 --unheld --baseline nccl \
      --rounds 3
done
part lane 60 bash -c "cd tools && exec python cuda_lane_cost.py '$LOGS/lane' 29791 1024"
[ -f "$LOGS/lane/lane-rank0.txt" ] && cat "$LOGS/lane/lane-rank0.txt"
for c in all_reduce all_gather reduce_scatter; do
  NCCL_RUNTIME_CONNECT=0 bench "bound_$c" 60 --collective "$c" -b 1K -e 256K -f 4 -n 300 -w 30 --unheld \
      --baseline nccl --bind gpu --rounds 3
done
# the bandwidth bars' sizes (8-16 MiB: at most NCCL's time; 128 MiB: 0.95x its bus bandwidth), three rounds
# (300 calls a size: with --scale-iters's handful at 8 MiB, NCCL's time read 74.3 us against 59.2 with
# 300, docs/results/4xh200/speed-run-8/bars.log against default-shapes/bars.log)
bench bars 90 --collective all_reduce -b 8M -e 128M -f 2 -n 300 -w 20 --baseline nccl --rounds 3
# where the hand-off to NCCL should begin: chorus's two-shot, chorus's hand-off and NCCL itself, three rounds
# the hand-offs as eager loops run them (the CPU's pace counts): all_gather and reduce_scatter where
# they go to NCCL (FSDP's sizes), all_to_all and broadcast at every size
for c in all_gather reduce_scatter; do
  NCCL_RUNTIME_CONNECT=0 bench "unheld_large_$c" 60 --collective "$c" -b 16M -e 64M -f 2 -n 100 -w 10 --unheld \
      --baseline nccl --rounds 3
done
for c in all_to_all broadcast; do
  NCCL_RUNTIME_CONNECT=0 bench "unheld_$c" 60 --collective "$c" -b 1K -e 16M -f 8 -n 100 -w 10 --unheld --baseline nccl \
      --rounds 3
done
bench handoff_from 100 --collective all_reduce -b 4M -e 32M -f 2 -n 100 -w 10 --scale-iters --baseline nccl \
    --algorithm two_shot_push,nccl --rounds 3

python - "$LOGS" <<'PY'
import json, os, sys
logs = sys.argv[1]

def human(n):
    for u, s in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= s and n % s == 0:
            return f"{n // s}{u}"
    return str(n)

def load(name):
    try:
        with open(os.path.join(logs, name + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

for name in ("all_reduce", "graph", "rails", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
             "unheld_all_reduce", "unheld_all_gather", "unheld_reduce_scatter", "bound_all_reduce",
             "bound_all_gather", "bound_reduce_scatter", "bars", "unheld_large_all_gather",
             "unheld_large_reduce_scatter", "unheld_all_to_all", "unheld_broadcast"):
    doc = load(name)
    if doc is None:
        print(f"\n== {name}: no results (see {name}.log)")
        continue
    by = {(r["library"], r["nbytes"]): r for r in doc["rows"]}
    print(f"\n== {name} {doc['dtype']} W={doc['world']} ({doc['device']}): GPU us per call; cpu = CPU us per call")
    for note in doc["notes"]:
        print("#", note)
    print(f"{'size':>6} {'chorus':>9} {'cpu':>6} {'lane':>8} {'cpu':>6} {'nccl':>9} {'cpu':>6} {'nccl/ch':>8}"
          f" {'symm1':>8} {'symm2':>8} {'#wrong':>7}")
    for size in sorted({r["nbytes"] for r in doc["rows"]}):
        c, l, n = by.get(("chorus", size)), by.get(("chorus-lane", size)), by.get(("nccl", size))
        s1, s2 = by.get(("symm-1shot", size)), by.get(("symm-2shot", size))
        us = lambda r: f"{r['seconds'] * 1e6:.1f}" if r else "-"
        cpu = lambda r: f"{r['cpu_seconds'] * 1e6:.1f}" if r else "-"
        ratio = f"{n['seconds'] / c['seconds']:.2f}x" if c and n and c["seconds"] else "-"
        wrong = ",".join(str(r["wrong"]) for r in (c, l, s1, s2) if r) or "-"
        print(f"{human(size):>6} {us(c):>9} {cpu(c):>6} {us(l):>8} {cpu(l):>6} {us(n):>9} {cpu(n):>6} {ratio:>8}"
              f" {us(s1):>8} {us(s2):>8} {wrong:>7}")

for name in ("calibrate", "handoff_from"):
    cal = load(name)
    if not cal:
        continue
    algos = [lib for lib in cal["libraries"] if lib.startswith("chorus:") or lib == "nccl"]
    label = lambda lib: lib[7:] if lib.startswith("chorus:") else "NCCL itself"
    by = {(r["library"], r["nbytes"]): r for r in cal["rows"]}
    print(f"\n== {name}: chorus all_reduce by algorithm (GPU us); ONE_SHOT_MAX_BYTES in chorus/cuda/algorithms.py, "
          "CHORUS_CUDA_NCCL_FROM_BYTES")
    for note in cal["notes"]:
        print("#", note)
    print(f"{'size':>6} " + " ".join(f"{label(a):>11}" for a in algos) + f" {'fastest':>11} {'#wrong':>7}")
    for size in sorted({r["nbytes"] for r in cal["rows"]}):
        got = {a: by[(a, size)] for a in algos if (a, size) in by}
        best = label(min(got, key=lambda a: got[a]["seconds"])) if got else "-"
        print(f"{human(size):>6} " + " ".join(f"{got[a]['seconds'] * 1e6:>11.1f}" if a in got else f"{'-':>11}"
                                              for a in algos)
              + f" {best:>11} {','.join(str(g['wrong']) for g in got.values()):>7}")
PY

echo "total $(($(date +%s) - START))s; logs and JSON in $LOGS"
# CHORUS_LOGS_TAR=FILE: every log also in one gzipped tar (for a runner that returns few files)
if [ -n "${CHORUS_LOGS_TAR:-}" ]; then
  packed=$(mktemp) && tar czf "$packed" -C "$LOGS" --exclude "$(basename "$CHORUS_LOGS_TAR")" . \
      && mv "$packed" "$CHORUS_LOGS_TAR" && echo "logs in $CHORUS_LOGS_TAR"
fi
exit "$FAILED"
