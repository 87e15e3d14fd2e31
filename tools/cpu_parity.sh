#!/usr/bin/env bash
# chorus against Open MPI (or MPICH) and gloo on one CPU host: the measurements behind
# "at least as fast as MPI at every size" (shared memory, W = 8), the TCP path against
# MPI restricted to TCP and against gloo, the settings that choose algorithms by size,
# and what Python itself costs per call.  Every part runs under `timeout`; a part that
# fails or times out is logged and the next one runs.  At most 495 s (the parts' limits), less on a 64-core host.
# The TCP parts time 1000 calls a size against MPI (200 against gloo), as the 16-vCPU
# runs in docs/results/16-vcpu-xeon/tcp-exchange/ were timed.
#
# usage:   PYTHONPATH=$PWD tools/cpu_parity.sh [OUT]        (from the repository root)
#          OUT: folder for the JSON and log files (default ./cpu-parity-logs, or $OUT)
# env:     CPU_PARITY_QUICK=1   tiny run (W = 2, few sizes and iterations): checks the script
#          MPIEXEC=PATH         the MPI launcher (default: chorus bench's choice)
#          CPU_PARITY_MPI_TCP_ARGS="..."  mpiexec options that keep MPI on TCP (default:
#                               by the launcher's --version: Open MPI or MPICH)
#          CPU_PARITY_PARTS="a b c d e"   the parts to run (default: all)
#
# parts (files in OUT):
#   a  shm-w8.json/.log            W=8 all_reduce 4 B..256 MiB, chorus vs gloo vs MPI (shared memory)
#   b  tcp-w8.json/.log            W=8 all_reduce 4 B..1 MiB, chorus --transport tcp vs gloo vs MPI on TCP
#   c  tcp-wN.json/.log            W=2,4,8,16 all_reduce 4 B..64 KiB over TCP, chorus vs gloo
#   d  oneshot-BYTES.json/.log     CHORUS_SHM_ONESHOT_BYTES calibration, W=8, 4 KiB..1 MiB
#   e  floor.log, call-cost.json   the least plain numpy over shared memory takes (W=8) next to
#                                  chorus's bare loop, pinned and not; per-call CPU cost at W=1
# summary.txt: each part's exit status and wall time.
set -u
OUT=${1:-${OUT:-./cpu-parity-logs}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PARTS=${CPU_PARITY_PARTS:-a b c d e}
BENCH=("$PY" -m chorus.cli bench)
MPI=()
[ -n "${MPIEXEC:-}" ] && MPI=(--mpiexec "$MPIEXEC")

if [ -n "${CPU_PARITY_QUICK:-}" ]; then
    W=2; BIG=64K; TCP_MAX=4K; SMALL_MAX=1K; WORLDS="2"; ITERS=5; WARM=1; TCP_ITERS=5; TCP_WARM=1
    CAL_SIZES=(-b 4K -e 16K -f 4); ONESHOT="16384 65536"; FLOOR_ITERS=2000; COST=(300 2)
    LIMIT_A=120; LIMIT_B=90; LIMIT_C=60; LIMIT_D=60; LIMIT_E=60
else
    W=8; BIG=256M; TCP_MAX=1M; SMALL_MAX=64K; WORLDS="2 4 8 16"; ITERS=50; WARM=5; TCP_ITERS=1000; TCP_WARM=50
    CAL_SIZES=(-b 4K -e 1M -f 2); ONESHOT="32768 65536 131072 262144 524288"; FLOOR_ITERS=10000
    COST=(3000 5)
    # at most 120 + 90 + 4 x 40 + 5 x 15 + 2 x 25 = 495 s
    LIMIT_A=120; LIMIT_B=90; LIMIT_C=40; LIMIT_D=15; LIMIT_E=25
fi

# mpiexec options that keep MPI off shared memory.  Open MPI: the ob1 PML (UCX would
# take shared memory whatever the BTLs) with the TCP and self BTLs, over loopback (by
# default its TCP BTL skips 127.0.0.0/8).  MPICH (ch4 over UCX or OFI): no local shm
# path, and the netmod's TCP provider.
mpi_tcp_args() {
    if [ -n "${CPU_PARITY_MPI_TCP_ARGS:-}" ]; then echo "$CPU_PARITY_MPI_TCP_ARGS"; return; fi
    local launcher=${MPIEXEC:-$(command -v mpiexec || true)}
    local version
    version=$("$launcher" --version 2>&1 | head -5)
    case "$version" in
        *"Open MPI"*|*"OpenRTE"*) echo "--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo" ;;
        *HYDRA*|*MPICH*) echo "-genv MPIR_CVAR_NOLOCAL 1 -genv UCX_TLS tcp,self -genv FI_PROVIDER tcp" ;;
        *) echo "" ;;
    esac
}

: > "$OUT/summary.txt"
part() {  # part NAME LIMIT_S COMMAND...: run with a time limit, log, note the outcome
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    echo "# $name: $*" | tee -a "$OUT/summary.txt"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local why=""
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why=" (timed out after ${limit} s)"
    echo "$name: exit $rc$why, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log"
}

wants() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if wants a; then
    part shm-w$W $LIMIT_A "${BENCH[@]}" --world $W --baseline all "${MPI[@]}" -b 4 -e $BIG -f 4 \
        -n $ITERS -w $WARM --scale-iters --json "$OUT/shm-w$W.json"
fi

if wants b; then
    TCP_ARGS=$(mpi_tcp_args)
    echo "# MPI over TCP with: ${TCP_ARGS:-(no options known for this launcher: MPI may use shared memory)}" \
        | tee -a "$OUT/summary.txt"
    part tcp-w$W $LIMIT_B "${BENCH[@]}" --world $W --transport tcp --baseline all "${MPI[@]}" \
        --mpi-args "$TCP_ARGS" -b 4 -e $TCP_MAX -f 4 -n $TCP_ITERS -w $TCP_WARM --json "$OUT/tcp-w$W.json"
fi

if wants c; then
    for w in $WORLDS; do
        part tcp-w$w-gloo $LIMIT_C "${BENCH[@]}" --world "$w" --transport tcp --baseline gloo -b 4 \
            -e $SMALL_MAX -f 4 -n $((TCP_ITERS / 5)) -w $TCP_WARM --json "$OUT/tcp-w$w-gloo.json"
    done
fi

if wants d; then  # chorus alone: the one-shot threshold at W (chorus.shm.collectives.one_shot)
    for b in $ONESHOT; do
        CHORUS_SHM_ONESHOT_BYTES=$b part oneshot-$b $LIMIT_D "${BENCH[@]}" --world $W --baseline none \
            "${CAL_SIZES[@]}" -n $((ITERS * 2)) -w $WARM --json "$OUT/oneshot-$b.json"
    done
fi

if wants e; then
    part floor $LIMIT_E bash -c "
        for pin in '' --pin; do
            for n in 1 1024; do
                $PY tools/latency_loop.py --floor \$pin $W \$n $FLOOR_ITERS
                $PY tools/latency_loop.py --native \$pin $W \$n $FLOOR_ITERS
                $PY tools/latency_loop.py \$pin $W \$n $FLOOR_ITERS
            done
        done"
    part call-cost $LIMIT_E "$PY" tools/call_cost.py "${COST[@]}" --json "$OUT/call-cost.json"
fi

{
    echo "# host: $(nproc) CPUs, $(uname -r), python $($PY -c 'import platform; print(platform.python_version())')"
    echo "# chorus: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
} >> "$OUT/summary.txt"
echo "wrote $OUT"
