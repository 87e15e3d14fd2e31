#!/usr/bin/env bash
# Run every seed example on this machine's GPUs twice -- as it is (import chorus as dist)
# and as a copy with the import swapped back (import torch.distributed as dist: NCCL for
# the GPU seeds, gloo for the CPU ones) -- and compare what they print.
#
#   OUT=/tmp/seeds-out examples/seeds/run_on_gpus.sh        # from anywhere
#
# One PASS/FAIL line per run; outputs, errors and diffs in $OUT (default: a new
# temporary folder).  Lines are compared sorted (ranks interleave differently), without
# torchrun's "[rankN]:" prefixes, numbers with more than 4 decimals rounded to 4
# significant digits (float sums in another order differ in the last bits).
#
# Settings (environment): NPROC (ranks of launcher-style runs, default 4: the seeds are
# written for 4), TIMEOUT_S (per run, default 300), CHORUS_LAUNCHER (the launcher of the
# chorus side of launcher-style runs; default torchrun as the seeds say -- chorus under
# torchrun needs chorus to join torchrun's agent store; "python3 -m chorus.run" is
# chorusrun, same flags), ONLY (names of the runs to do, e.g. ONLY="p2p_sync reduce").
# Exit status: the number of FAILs (0: all passed).
set -u

SEEDS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$SEEDS/../.." && pwd)"
export NCCL_NVLS_ENABLE=0
unset PYTHONUNBUFFERED  # buffered output reaches the shared file whole lines at a time
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
NPROC="${NPROC:-4}"
TIMEOUT_S="${TIMEOUT_S:-300}"
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc-per-node=$NPROC"
CHORUS_LAUNCHER="${CHORUS_LAUNCHER:-python3 -m torch.distributed.run}"
OUT="${OUT:-$(mktemp -d /tmp/chorus-seeds-gpu-XXXXXX)}"
mkdir -p "$OUT"

# the torch.distributed copy: every module of the folder, its import line swapped back
TORCH_DIR="$OUT/torch_variant"
rm -rf "$TORCH_DIR" && mkdir -p "$TORCH_DIR"
cp "$SEEDS"/*.py "$TORCH_DIR/"
sed -i -E 's/^import chorus as dist\b.*$/import torch.distributed as dist/' "$TORCH_DIR"/*.py
# basic_collectives.py hands CPU tensors to an "nccl" group: torch's NCCL refuses them
# ("No backend type associated with device type cpu"), while a chorus group takes CPU and
# CUDA tensors whatever its backend's name; its torch run uses gloo, which prints what the
# seed means to print
sed -i 's/backend="nccl"/backend="gloo"/' "$TORCH_DIR/basic_collectives.py"
if grep -qE '^\s*(import|from)\s+chorus\b' "$TORCH_DIR"/*.py; then
    echo "run_on_gpus.sh: the torch copy still imports chorus" >&2
    exit 1
fi

python3 - <<'EOF' || exit 1
import torch
print(f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s), NCCL {torch.cuda.nccl.version() if torch.cuda.is_available() else '-'}")
EOF

# name | how | file | lines left out of the comparison (regex; empty: none)
#   python: python3 file.py (mp.spawn-style seeds start their ranks themselves)
#   single: one process with the seed's environment
#   launch: torchrun --standalone --nproc-per-node=$NPROC file.py
RUNS="
p2p_sync|python|p2p_sync.py|
p2p_async|python|p2p_async.py|
broadcast|python|broadcast.py|
reduce|python|reduce.py|^Rank [1-9] reduce to rank 0:
gather|python|gather.py|
reduce_scatter|python|reduce_scatter.py|
ring_allreduce|python|ring_allreduce.py|
all_to_all|python|all_to_all.py|
init_methods|single|init_methods.py|
torchrun_env|launch|torchrun_env.py|
torchrun_all_reduce|launch|torchrun_all_reduce.py|
spawn_all_reduce|python|spawn_all_reduce.py|
basic_collectives|python|basic_collectives.py|
subgroups|launch|subgroups.py|
helpers_debug|launch|helpers_debug.py|
helpers_debug_alone|python|helpers_debug.py|
helpers_training|launch|helpers_training.py|
helpers_training_alone|python|helpers_training.py|
"
# (reduce.py: torch's gloo uses the tensors of ranks other than dst as scratch space and
#  documents only dst's result; the seed prints every rank's.)

normalize() {  # normalize FILE IGNORE_REGEX
    python3 - "$1" "$2" <<'EOF'
import re, sys
path, ignore = sys.argv[1], sys.argv[2]
text = open(path, errors="replace").read()
# two ranks' prints can share a line when their writes interleave: a "rank N: " that does
# not start its line starts a new one (and the empty line left behind is dropped)
text = re.sub(r"(?<=[^\s:])(?=rank \d+: )", "\n", text)
lines = [re.sub(r"^\[(default)?rank\d+\]:", "", ln) for ln in text.splitlines() if ln.strip()]
lines = [ln for ln in lines if not (ignore and re.search(ignore, ln))]
lines = [re.sub(r"\d+\.\d{5,}", lambda m: f"{float(m[0]):.4g}", ln) for ln in lines]
print("\n".join(sorted(lines)))
EOF
}

run_one() {  # run_one VARIANT DIR NAME HOW FILE -> exit status; output in $OUT
    local variant=$1 dir=$2 name=$3 how=$4 file=$5
    local work="$OUT/work/$variant-$name"
    rm -rf "$work" && mkdir -p "$work"   # helpers_training writes checkpoint.pt into it
    local launcher="$TORCHRUN"
    [ "$variant" = chorus ] && launcher="$CHORUS_LAUNCHER --standalone --nproc-per-node=$NPROC"
    (
        cd "$work" || exit 1
        case $how in
            python) exec timeout "$TIMEOUT_S" python3 "$dir/$file" ;;
            single) MASTER_ADDR=127.0.0.1 MASTER_PORT=12801 RANK=0 WORLD_SIZE=1 \
                        exec timeout "$TIMEOUT_S" python3 "$dir/$file" ;;
            launch) exec timeout "$TIMEOUT_S" $launcher "$dir/$file" ;;
        esac
    ) >"$OUT/$name.$variant.out" 2>"$OUT/$name.$variant.err"
}

fails=0
while IFS='|' read -r name how file ignore; do
    [ -z "$name" ] && continue
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then continue; fi
    run_one chorus "$SEEDS" "$name" "$how" "$file"; rc_chorus=$?
    run_one torch "$TORCH_DIR" "$name" "$how" "$file"; rc_torch=$?
    normalize "$OUT/$name.chorus.out" "$ignore" >"$OUT/$name.chorus.sorted"
    normalize "$OUT/$name.torch.out" "$ignore" >"$OUT/$name.torch.sorted"
    if diff -u "$OUT/$name.torch.sorted" "$OUT/$name.chorus.sorted" >"$OUT/$name.diff"; then same=1; else same=0; fi
    if [ "$rc_chorus" = 0 ] && [ "$rc_torch" = 0 ] && [ "$same" = 1 ]; then
        printf 'PASS  %-24s %s lines\n' "$name" "$(wc -l <"$OUT/$name.chorus.sorted")"
    else
        fails=$((fails + 1))
        why="exit chorus $rc_chorus, torch $rc_torch"
        [ "$same" = 1 ] || why="$why; output differs: $OUT/$name.diff"
        printf 'FAIL  %-24s %s\n' "$name" "$why"
    fi
done <<<"$RUNS"

echo "$fails failed; outputs in $OUT"
exit "$fails"
