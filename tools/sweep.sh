#!/bin/bash
# The runs behind docs/benchmarks.md's tables, each writing the result file that
# docs/make_tables.py reads (copy them into docs/results/<machine class>/, then run
# python3 docs/make_tables.py). Run from the repository root; chorus need not be installed.
#
# usage: tools/sweep.sh OUTDIR PART [COLLECTIVES]
#   w8      every collective (or COLLECTIVES) at W = 8 against $BASELINE (default gloo):
#           OUTDIR/<collective>-w8-<baseline>.json
#   small   all_reduce up to 1 KiB at W = 8 against gloo and MPI: OUTDIR/all_reduce-small-w8.json
#   reg     all_reduce at W = 8 on registered buffers against gloo: OUTDIR/all_reduce-w8-gloo-registered.json
#   ddp     a DDP step at W = 8 against gloo: default, buckets in private memory, and the
#           bucket view with glibc's allocator kept from returning memory: OUTDIR/ddp-w8-*.json
#   w2      all_reduce at W = 2 against MPI, $RUNS times (default 4): OUTDIR/all_reduce-w2-mpi-N.json
# W = 8 needs a host with at least 8 CPUs (16 for chorus's helper threads to have cores).
set -eu
out=$1; part=$2; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
bench() { python3 -m chorus.cli bench "$@"; }
ddp() { python3 -m chorus.cli bench-ddp --world 8 --batch 8 --steps 30 "$@"; }
case $part in
w8)
  base=${BASELINE:-gloo}
  for c in ${3:-all_reduce all_gather reduce_scatter broadcast all_to_all}; do
    bench --collective $c -b 4 -e 256M -f 4 -n 1000 -w 100 --scale-iters --world 8 --transport shm \
      --baseline $base --json "$out/$c-w8-$base.json"
  done ;;
small)
  bench --collective all_reduce -b 4 -e 1K -f 4 -n 4000 -w 400 --world 8 --transport shm --baseline all \
    --json "$out/all_reduce-small-w8.json" ;;
reg)
  bench --collective all_reduce -b 4 -e 256M -f 4 -n 1000 -w 100 --scale-iters --world 8 --transport shm \
    --baseline gloo --registered --json "$out/all_reduce-w8-gloo-registered.json" ;;
ddp)
  ddp --json "$out/ddp-w8-default.json"
  CHORUS_TORCH_SHARE=0 ddp --json "$out/ddp-w8-private-buckets.json"
  MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=17179869184 \
    ddp --grad-as-bucket-view --json "$out/ddp-w8-bucket-view-malloc.json" ;;
w2)
  for i in $(seq 1 "${RUNS:-4}"); do
    bench --collective all_reduce -b 4 -e 16M -f 4 -n 2000 -w 200 --scale-iters --world 2 --transport shm \
      --baseline mpi --json "$out/all_reduce-w2-mpi-$i.json"
  done ;;
*)
  sed -n '2,14p' "$0" >&2; exit 2 ;;
esac
