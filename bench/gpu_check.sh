#!/usr/bin/env bash
# The GPU checks of the device backend (cgp/device/) for a lent machine with an NVIDIA GPU, in
# one command: the machine's description, the GPU-marked tests, one hash for 1-4 ranks
# sharing the GPU (several ranks on one device stand in for several devices) with the float64
# check against the CPU engine, and `cgp bench speedup --device gpu --compare torch` (PyTorch
# on the same GPU, default and deterministic modes) for LeNet, cifar10_quick (generated
# CIFAR-10 files) and ResNet-50 at batch 32. Results (logs, JSON, CSV) land in OUTDIR.
#
#     bash bench/gpu_check.sh OUTDIR            # DEVICE=numpy: the same on the host, to try it
#
# Written for the lent machines' image (CuPy, PyTorch, mpi4py, no network): cgp goes in
# with --no-deps. Each part has a time limit, so a hung part leaves the others' results.
set -u -o pipefail
out=${1:?usage: bash bench/gpu_check.sh OUTDIR}
device=${DEVICE:-gpu}
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")/.." && pwd)
zoo=${ZOO:-$here/../shared/data/caffe/zoo}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# cuBLAS is deterministic only with this set before CUDA starts (for PyTorch's mode too).
export CUBLAS_WORKSPACE_CONFIG=:4096:8

step() {
    echo "== $*"
    timeout "${LIMIT:-240}" "$@" || echo "== exit $? from: $*"
}

$py -c "import cgp" 2>/dev/null || $py -m pip install -q --no-deps --no-build-isolation -e "$here"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    $py -c "import numpy, numba; print('numpy', numpy.__version__, 'numba', numba.__version__)"
    $py -c "import cupy; print('cupy', cupy.__version__)" 2>&1
    $py -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())" 2>&1
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

cd "$here"
step $py -m pytest -q -rs tests/test_device.py 2>&1 | tee "$out/tests.log"
step $py -m cgp equivalence mnist --device "$device" --ranks 1,2,3,4 --iters "${ITERS:-100}" \
    2>&1 | tee "$out/equivalence.log"
data=$(mktemp -d)
$py bench/fake_cifar10.py "$data" >/dev/null
common=(--device "$device" --threads 1 --compare torch --torch-layout channels_last
        --repeats "${REPEATS:-5}" --warmup 3 --lead-in 3 --out "$out")
{
    step $py -m cgp bench speedup mnist --iters 50 "${common[@]}"
    step $py -m cgp bench speedup cifar10 --data-dir "$data" --iters 20 "${common[@]}"
    step $py -m cgp bench speedup --model "$zoo/resnet50/ResNet-50-deploy.prototxt" --batch 32 \
        --iters 3 "${common[@]}"
} 2>&1 | tee "$out/speed.log"
