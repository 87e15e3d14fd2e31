#!/bin/bash
# Device sweeps for docs/benchmarks.md: run from the repository root on the 16-core host.
# usage: bench/device_sweep.sh OUTDIR PART
set -u
out=$1; part=$2; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
b() { python3 -m chorus.cli bench "$@"; }
case $part in
variants)  # chorus only: copy path (skew 0 / 2048) vs single copy, large sizes
  for c in all_reduce all_gather broadcast all_to_all reduce_scatter; do
    for v in "CHORUS_SHM_CMA=0 CHORUS_SHM_SKEW=0" "CHORUS_SHM_CMA=0" "CHORUS_SHM_CMA_BYTES=1"; do
      echo "== $c $v"
      env $v python3 -m chorus.cli bench --collective $c -b 64K -e 256M -f 4 -n 50 -w 5 --scale-iters \
        --world 8 --transport shm --baseline none --json "$out/var-$c-$(echo $v | tr ' =' '_-').json" | tail -n +4
    done
  done ;;
w8)  # every collective vs gloo (and MPI), W = 8
  for c in ${3:-all_reduce all_gather reduce_scatter broadcast all_to_all reduce barrier sendrecv}; do
    b --collective $c -b 4 -e 256M -f 4 -n 200 -w 20 --scale-iters --world 8 --transport shm \
      --baseline all --json "$out/$c-w8.json" | tail -n +3
  done ;;
esac
