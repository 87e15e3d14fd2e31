#!/bin/bash
# Device sweeps for docs/benchmarks.md: run from the repository root on the 16-core host.
# usage: bench/device_sweep.sh OUTDIR PART
set -u
out=$1; part=$2; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
b() { python3 -m chorus.cli bench "$@"; }
case $part in
variants)  # chorus only: copy path (skew 0 / 2048) vs single copy, large sizes
  # (the 2026-11-26 run also had "CHORUS_SHM_CMA=0 CHORUS_SHM_SKEW=0", an override since removed)
  for c in all_reduce all_gather broadcast all_to_all reduce_scatter; do
    for v in "CHORUS_SHM_CMA=0" "CHORUS_SHM_CMA_BYTES=1"; do
      echo "== $c $v"
      env $v python3 -m chorus.cli bench --collective $c -b 64K -e 256M -f 4 -n 50 -w 5 --scale-iters \
        --world 8 --transport shm --baseline none --json "$out/var-$c-$(echo $v | tr ' =' '_-').json" | tail -n +4
    done
  done ;;
w8)  # every collective (or those named in $3) vs gloo and MPI ($BASELINE: all), W = 8
  for c in ${3:-all_reduce all_gather reduce_scatter broadcast all_to_all reduce barrier sendrecv}; do
    b --collective $c -b 4 -e 256M -f 4 -n 1000 -w 100 --scale-iters --world 8 --transport shm \
      --baseline ${BASELINE:-all} --json "$out/$c-w8.json" | tail -n +3
  done ;;
ab)  # chorus's copy path, single copy and gloo alternating op by op, W = 2, 4, 8 (cma_bytes)
  for w in 2 4 8; do
    python3 bench/ab_probe.py $w "$out/ab-w$w" 5 all_reduce,broadcast,all_gather,all_to_all,reduce_scatter \
      1,4,16,64,256
  done ;;
w24)  # every collective vs gloo and MPI, W = 2 and 4, every 16x in size
  for w in 2 4; do
    for c in all_reduce all_gather reduce_scatter broadcast all_to_all reduce barrier sendrecv; do
      b --collective $c -b 4 -e 256M -f 16 -n 200 -w 20 --scale-iters --world $w --transport shm \
        --baseline all --json "$out/$c-w$w.json" | tail -n +3
    done
  done ;;
reg)  # ordinary against registered buffers (chorus.empty_shared), both against gloo, W = 8
  for c in ${3:-all_reduce all_to_all}; do
    for r in "" --registered; do
      b --collective $c -b 1M -e 256M -f 4 -n 200 -w 20 --scale-iters --world 8 --transport shm \
        --baseline gloo $r --json "$out/$c-w8${r:+-reg}.json" | tail -n +3
    done
  done ;;
ddp)  # issue 5: a DDP step of a 25M-parameter MLP, W = 8, chorus vs gloo in one run
  python3 -m chorus.cli bench-ddp --world 8 --batch 8 --steps 30 --json "$out/ddp-w8-b8.json"
  CHORUS_TORCH_SHARE=0 python3 -m chorus.cli bench-ddp --world 8 --batch 8 --steps 30 \
    --json "$out/ddp-w8-b8-noshare.json"  # buckets not moved into shared memory (the copy path)
  MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=17179869184 \
    python3 -m chorus.cli bench-ddp --world 8 --batch 8 --steps 30 --grad-as-bucket-view \
    --json "$out/ddp-w8-b8-tuned.json" ;;
esac
