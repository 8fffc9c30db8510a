#!/usr/bin/env bash
# The plan for a lent machine with 16 cores, in one command. First the layouts of ranks x
# workers (issue 49; about 8 minutes, ONLY=ranks stops after them): LeNet and cifar10_quick
# (on generated CIFAR-10 files) trained as 1 x 16, 2 x 8, 4 x 4 and 16 x 1 (bench/staleness.py
# at S = 0: interleaved rounds, the median display speed), the ceiling of 16 one-worker copies
# beside 1 x 16 (`cgp bench speedup --ceiling`), and where each layout's CPU goes
# (bench/rank_time.py). Then the 1 - 16 worker runs: the machine's description and its own
# ceiling for 16 one-thread loops (bench/machine_scaling.py), `cgp bench speedup` for LeNet and
# cifar10_quick, each with the ceiling of N one-thread trainings and PyTorch at the same thread
# counts, how even the steps of 1 and 16 workers are (bench/step_tail.py), what a 16-worker
# call costs beside a 2-worker one and how much of it is Python (bench/call_size.py), LeNet on
# workers as threads, and the bitwise check. One command, so that a borrowed machine's minutes
# go to measuring; the results (JSON, CSV, PNG) land in OUTDIR (write the log there too:
# `... 2>&1 | tee OUTDIR/many_cores.log`).
#
#     bash bench/many_cores.sh OUTDIR [THREADS]        # THREADS default 1,2,4,8,16
#
# CORES (default: the last of THREADS) sets the layouts: 1 x C, 2 x C/2, 4 x C/4, C x 1 (those
# that divide); RANK_ITERS and RANK_ROUNDS (default 400 and 3; cifar10_quick a quarter of the
# iterations, and 2 rounds) scale the layout runs down: `CORES=2 RANK_ITERS=40 RANK_ROUNDS=1
# ONLY=ranks bash bench/many_cores.sh OUT 1,2` checks the plan on a small machine.
set -u -o pipefail
out=${1:?usage: bash bench/many_cores.sh OUTDIR [THREADS]}
threads=${2:-1,2,4,8,16}
top=${threads##*,}
py=${PYTHON:-python3}
mkdir -p "$out"
here=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1

{
    date -u
    nproc
    lscpu
    $py - <<'EOF'
import platform, numpy, numba, psutil
print("python", platform.python_version(), "numpy", numpy.__version__, "numba", numba.__version__)
print("physical cores", psutil.cpu_count(logical=False), "logical", psutil.cpu_count())
EOF
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

step() {   # a time limit per part, so that one hung part still leaves the others' results
    echo "== $*"
    timeout 300 "$@" || echo "== exit $? from: $*"
}

cifar=$(mktemp -d)
$py "$here/bench/fake_cifar10.py" "$cifar" >/dev/null

# -- the layouts of ranks x workers ----------------------------------------------------------
cores=${CORES:-$top}
iters=${RANK_ITERS:-400}
rounds=${RANK_ROUNDS:-3}
layouts=""
for r in 1 2 4 "$cores"; do
    if [ $((cores % r)) -eq 0 ] && [[ ",$layouts," != *",${r}x$((cores / r)),"* ]]; then
        layouts="${layouts:+$layouts,}${r}x$((cores / r))"
    fi
done
step $py "$here/bench/staleness.py" lenet --staleness 0 --layouts "$layouts" --iters "$iters" \
    --display $((iters / 4)) --rounds "$rounds"
step $py "$here/bench/staleness.py" cifar10_quick --staleness 0 --layouts "$layouts" \
    --iters $((iters / 4)) --display $((iters / 16)) --rounds $(((rounds + 1) / 2)) \
    --data-dir "$cifar"
step $py -m cgp bench speedup mnist --threads "1,$cores" --iters "$iters" --lead-in 20 \
    --repeats "$rounds" --ceiling --out "$out/layouts"
step $py -m cgp bench speedup cifar10_quick --threads "1,$cores" --iters $((iters / 10)) \
    --lead-in 5 --repeats "$rounds" --ceiling --data-dir "$cifar" --out "$out/layouts"
step $py "$here/bench/rank_time.py" lenet --layouts "$layouts" --from $((iters / 4)) \
    --to "$iters"
if [ "${ONLY:-}" = ranks ]; then
    rm -rf "$cifar"
    exit 0
fi

# -- 1 - 16 workers --------------------------------------------------------------------------
step $py "$here/bench/machine_scaling.py" --workload scalar,sgemm,stream,lenet --copies 1,8,"$top" \
    --seconds 3 --rounds 3
# Timings of 100 (LeNet) and 20 (cifar10_quick) iterations, about 0.2 s at 16 workers: on a
# machine whose speed moves from one 50 ms to the next, 20-iteration timings (45 ms) spread
# widely (bench/README.md, "On 16 cores").
step $py -m cgp bench speedup mnist --threads "$threads" --iters 100 --lead-in 20 --repeats 5 \
    --ceiling --compare torch --out "$out"
step $py -m cgp bench speedup cifar10_quick --threads "$threads" --iters 20 --lead-in 5 \
    --repeats 5 --ceiling --compare torch --data-dir "$cifar" --out "$out"
step $py "$here/bench/step_tail.py" mnist --threads "1,$top" --steps 500
step $py "$here/bench/step_tail.py" cifar10_quick --threads "1,$top" --steps 100 \
    --data-dir "$cifar"
# The one-chunk calls of 16 workers against the calls of 8 and 2 chunks that 2 workers make.
step $py "$here/bench/call_size.py" mnist --group 8
step $py "$here/bench/call_size.py" cifar10_quick --group 2 --rounds 9 --data-dir "$cifar"
# Workers as threads, whose calls hold the interpreter lock for less since bound layer calls:
# whether more than cgp.options.THREAD_WORKERS_SCALE of them now run faster.
step $py -m cgp bench speedup mnist --threads "$threads" --workers threads --iters 100 \
    --lead-in 20 --repeats 3 --out "$out"
step $py -m cgp equivalence mnist --threads "$threads" --iters 100 --workers threads,processes
rm -rf "$cifar"
