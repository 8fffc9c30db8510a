#!/usr/bin/env bash
# The 1 - 16 worker runs for a lent machine with 16 cores: the machine's description and its
# own ceiling for 16 one-thread loops (bench/machine_scaling.py), then `cgp bench speedup` for
# LeNet and cifar10_quick (on generated CIFAR-10 files), each with the ceiling of N one-thread
# trainings and PyTorch at the same thread counts, then how even the steps of 1 and 16 workers
# are (bench/step_tail.py), what a 16-worker call costs beside a 2-worker one and how much of
# it is Python (bench/call_size.py), LeNet on workers as threads, and the bitwise check. One
# command, so that a borrowed machine's minutes go to measuring; the results (JSON, CSV, PNG)
# land in OUTDIR (write the log there too: `... 2>&1 | tee OUTDIR/many_cores.log`).
#
#     bash bench/many_cores.sh OUTDIR [THREADS]        # THREADS default 1,2,4,8,16
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

step $py "$here/bench/machine_scaling.py" --workload scalar,sgemm,stream,lenet --copies 1,8,"$top" \
    --seconds 3 --rounds 3
# Timings of 100 (LeNet) and 20 (cifar10_quick) iterations, about 0.2 s at 16 workers: on a
# machine whose speed moves from one 50 ms to the next, 20-iteration timings (45 ms) spread
# widely (bench/README.md, "On 16 cores").
step $py -m cgp bench speedup mnist --threads "$threads" --iters 100 --lead-in 20 --repeats 5 \
    --ceiling --compare torch --out "$out"
cifar=$(mktemp -d)
$py "$here/bench/fake_cifar10.py" "$cifar" >/dev/null
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
