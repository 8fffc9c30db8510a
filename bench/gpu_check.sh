#!/usr/bin/env bash
# The GPU checks of the device backend (cgp/device/, issue 50) for a lent machine with an
# NVIDIA GPU, in one command that ends within BUDGET seconds (default 470: the lent 8
# minutes less the start). Parts in order of importance, each with its own time limit (cut
# to what is left of the budget; a part with under 15 s left is skipped, and says so), each
# part's output written to OUTDIR as it runs and one line per part to OUTDIR/summary.txt:
#
#   machine   the GPU, driver, versions; whether Numba compiles CUDA here (NVVM), which
#             decides if cgp/kernels/cuda_gemm.py can run (cgp.device.cuda_kernels)
#   tests     the GPU-marked tests: the device engine on CuPy against the CPU engine in
#             float64, the CUDA kernel compiled, whether cuBLAS gives a chunk the same bits
#             alone and among 16, the device step's update and tree sum
#   ranks     one hash for 1, 2, 3 and 4 ranks sharing the GPU (float32; the only precision
#             the GPU path has: no --precision tf32 yet)
#   speed     cgp bench speedup --device gpu --compare torch (PyTorch default and
#             deterministic modes, TF32 off) for LeNet b64, cifar10_quick b100, ResNet-50
#             b32 and GoogLeNet b32
#   memory    ResNet-50 b32: CuPy's pool after training against torch.cuda.max_memory_allocated
#
#     bash bench/gpu_check.sh OUTDIR
#     DEVICE=numpy BUDGET=600 bash bench/gpu_check.sh OUTDIR    # the same flow on the host
#
# Written for the lent machines' image (Python 3.12, CuPy, PyTorch, Numba, mpi4py; no
# network): cgp goes in with --no-deps. Counts: ITERS (ranks), SPEED_ITERS, REPEATS.
set -u -o pipefail
out=${1:?usage: bash bench/gpu_check.sh OUTDIR}
device=${DEVICE:-gpu}
py=${PYTHON:-python3}
budget=${BUDGET:-470}
here=$(cd "$(dirname "$0")/.." && pwd)
zoo=${ZOO:-$here/../shared/data/caffe/zoo}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# cuBLAS is deterministic only with this set before CUDA starts (for PyTorch's mode too).
export CUBLAS_WORKSPACE_CONFIG=:4096:8
start=$SECONDS
: >"$out/summary.txt"

# part NAME LIMIT LOG COMMAND...: runs COMMAND with at most LIMIT seconds (less if the budget
# has less left), its output into OUTDIR/LOG as it comes, a line into summary.txt.
part() {
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$((budget - (SECONDS - start)))
    if ((left < 15)); then
        echo "$name: skipped, $left s of the budget left" | tee -a "$out/summary.txt"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit $limit s): $*"
    local t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@" >"$out/$log" 2>&1
    local rc=$?
    tail -n 15 "$out/$log"
    local verdict="exit $rc"
    ((rc == 124 || rc == 137)) && verdict="cut at its limit ($limit s)"
    echo "$name: $verdict after $((SECONDS - t0)) s; log $log" | tee -a "$out/summary.txt"
}

$py -c "import cgp" 2>/dev/null || $py -m pip install -q --no-deps --no-build-isolation -e "$here"
cd "$here"
{
    date -u
    echo "device $device, budget $budget s"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    $py -c "import numpy, numba; print('numpy', numpy.__version__, 'numba', numba.__version__)"
    $py -c "import cupy; print('cupy', cupy.__version__)" 2>&1 | tail -n 1
    $py -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())" 2>&1 | tail -n 1
    $py -c "import mpi4py; print('mpi4py', mpi4py.__version__)" 2>&1 | tail -n 1
    timeout 60 $py -c "from cgp.device import cuda_kernels; print('numba cuda kernels:', *cuda_kernels())" 2>&1 | tail -n 1
    # Whether Open MPI could send device buffers (the exchange stages them through the host).
    echo "CUDA-aware MPI: $(ompi_info --parsable --all 2>/dev/null | grep -m1 mpi_built_with_cuda_support:value || echo unknown)"
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

# -- 1. the GPU-marked tests (and the device step's, which run anywhere) -----------------
part tests 120 tests.log $py -m pytest -q -rs -p no:cacheprovider tests/test_cuda_gemm.py \
    tests/test_device_step.py tests/test_device.py \
    -k "gpu or cuda or cublas or update or tree_sum or moving or protocol"

# -- 2. one hash for 1-4 ranks sharing the GPU -------------------------------------------
part ranks 75 ranks.log $py -m cgp equivalence mnist --device "$device" --ranks 1,2,3,4 \
    --iters "${ITERS:-30}"

# -- 3. speed against PyTorch (TF32 off on both sides: CuPy's matmul has it off unless
# CUPY_TF32=1; PyTorch's cuDNN has it on by default, turned off here) ------------------------
data=$(mktemp -d)
$py bench/fake_cifar10.py "$data" >/dev/null
compare=()
if $py -c "import torch" 2>/dev/null; then
    compare=(--compare torch --torch-layout channels_last)
else
    echo "speed: PyTorch is not installed: cgp alone" | tee -a "$out/summary.txt"
fi
run_cgp='import sys
try:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
except ImportError:
    pass
from cgp.cli import main
sys.exit(main(sys.argv[1:]))'
common=(--device "$device" --threads 1 "${compare[@]}" --repeats "${REPEATS:-3}" --warmup 2
        --lead-in 1)
part speed_lenet 45 speed_lenet.log $py -c "$run_cgp" bench speedup mnist \
    --iters "${SPEED_ITERS:-20}" "${common[@]}" --out "$out/lenet"
part speed_cifar10 45 speed_cifar10.log $py -c "$run_cgp" bench speedup cifar10 \
    --data-dir "$data" --iters "${SPEED_ITERS:-20}" "${common[@]}" --out "$out/cifar10"
# The large nets: one timed iteration per repeat, no minimum time (at today's speed an
# iteration of ResNet-50 b32 takes seconds).
large=(--device "$device" --threads 1 "${compare[@]}" --repeats 1 --warmup 1 --lead-in 0
       --min-seconds 0 --iters 1)
part speed_resnet50 90 speed_resnet50.log $py -c "$run_cgp" bench speedup \
    --model "$zoo/resnet50/ResNet-50-deploy.prototxt" --batch 32 "${large[@]}" \
    --out "$out/resnet50"
part speed_googlenet 50 speed_googlenet.log $py -c "$run_cgp" bench speedup \
    --model "$zoo/bvlc_googlenet/deploy.prototxt" --batch 32 "${large[@]}" \
    --out "$out/googlenet"

# -- 4. peak memory, ResNet-50 b32 --------------------------------------------------------
part memory 45 memory.log $py bench/gpu_memory.py "$zoo/resnet50/ResNet-50-deploy.prototxt" \
    --batch 32 --iters 2 --device "$device"
rm -rf "$data"
echo "total $((SECONDS - start)) s of the $budget s budget" | tee -a "$out/summary.txt"
