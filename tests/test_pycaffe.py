"""pycaffe's interface (`import cgp as caffe`): short scripts as Caffe's tutorials write them."""
import subprocess
import sys

import numpy as np
import pytest

import cgp as caffe
from cgp import models
from cgp.errors import CgpError
from cgp.prototxt import parse_net

L, P = caffe.layers, caffe.params


def lenet(source, batch_size):
    """The net of Caffe's "Learning LeNet" notebook, written with NetSpec as it does."""
    n = caffe.NetSpec()
    n.data, n.label = L.Data(batch_size=batch_size, source=source, ntop=2,
                             transform_param=dict(scale=1. / 255))
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20,
                            weight_filler=dict(type="xavier"))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50,
                            weight_filler=dict(type="xavier"))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool="MAX")
    n.fc1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type="xavier"))
    n.relu1 = L.ReLU(n.fc1, in_place=True)
    n.score = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.score, n.label)
    return n.to_proto()


def tutorial_solver(folder, caffe_dir, **fields):
    """Caffe's lenet_auto_solver.prototxt, with the tutorial's nets written by NetSpec into
    folder/mnist/ and the solver's other fields as given."""
    from cgp.prototxt import format_message, read_solver
    (folder / "mnist").mkdir(exist_ok=True)
    (folder / "mnist/lenet_auto_train.prototxt").write_text(str(lenet("mnist:train", 64)))
    (folder / "mnist/lenet_auto_test.prototxt").write_text(str(lenet("mnist:test", 100)))
    sp = read_solver(caffe_dir / "prototxt/lenet_auto_solver.prototxt")
    for key, value in fields.items():
        setattr(sp, key, value)
    path = folder / "lenet_auto_solver.prototxt"
    path.write_text(format_message(sp))
    return str(path)


def test_netspec_writes_lenet_as_caffe_reads_it(tmp_path, mnist_dir):
    text = str(lenet("mnist:train", 64))
    proto = parse_net(text)
    assert [(l.name, l.type, list(l.bottom), list(l.top)) for l in proto.layer] == [
        ("data", "Data", [], ["data", "label"]),
        ("conv1", "Convolution", ["data"], ["conv1"]),
        ("pool1", "Pooling", ["conv1"], ["pool1"]),
        ("conv2", "Convolution", ["pool1"], ["conv2"]),
        ("pool2", "Pooling", ["conv2"], ["pool2"]),
        ("fc1", "InnerProduct", ["pool2"], ["fc1"]),
        ("relu1", "ReLU", ["fc1"], ["fc1"]),      # in place, named after its attribute
        ("score", "InnerProduct", ["fc1"], ["score"]),
        ("loss", "SoftmaxWithLoss", ["score", "label"], ["loss"])]
    data, conv1, pool1 = proto.layer[0], proto.layer[1], proto.layer[2]
    assert data.data_param.batch_size == 64 and data.data_param.source == "mnist:train"
    assert data.transform_param.scale == pytest.approx(1 / 255)
    assert list(conv1.convolution_param.kernel_size) == [5]
    assert conv1.convolution_param.weight_filler.type == "xavier"
    assert pool1.pooling_param.pool == P.Pooling.MAX == proto.layer[4].pooling_param.pool
    # Written to a file, it loads back as a net that runs.
    path = tmp_path / "lenet_auto_train.prototxt"
    path.write_text(text)
    net = caffe.Net(str(path), caffe.TRAIN, data_dir=str(mnist_dir))
    assert list(net.blobs) == ["data", "label", "conv1", "pool1", "conv2", "pool2", "fc1",
                               "score", "loss"]
    assert np.isfinite(net.forward()["loss"])


def test_netspec_names_unassigned_tops_and_refuses_unknown_fields():
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3]))
    n.out = L.InnerProduct(L.TanH(n.data), num_output=4, param=[dict(lr_mult=1),
                                                               dict(lr_mult=2)])
    proto = n.to_proto()
    assert [l.name for l in proto.layer] == ["data", "TanH1", "out"]
    assert list(proto.layer[0].input_param.shape[0].dim) == [2, 3]
    assert [p.lr_mult for p in proto.layer[2].param] == [1, 2]
    with pytest.raises(CgpError, match="kernel_sise"):
        n.bad = L.Convolution(n.data, kernel_sise=3)
        n.to_proto()


def test_lenet_tutorial_step_loop(tmp_path, caffe_dir, mnist_dir, monkeypatch):
    """The "Learning LeNet" notebook's loop: step(1), read the train loss, score the test net
    from conv1 on, and count correct test predictions from the blobs."""
    monkeypatch.chdir(tmp_path)
    path = tutorial_solver(tmp_path, caffe_dir, max_iter=30, snapshot=0)
    caffe.set_mode_cpu()
    solver = caffe.SGDSolver(path, data_dir=str(mnist_dir))
    assert [k for k in solver.net.blobs] == ["data", "label", "conv1", "pool1", "conv2",
                                             "pool2", "fc1", "score", "loss"]
    assert [(k, v[0].data.shape) for k, v in solver.net.params.items()] == [
        ("conv1", (20, 1, 5, 5)), ("conv2", (50, 20, 5, 5)), ("fc1", (500, 800)),
        ("score", (10, 500))]
    niter = 30
    train_loss = np.zeros(niter)
    output = np.zeros((niter, 8, 10))
    for it in range(niter):
        solver.step(1)
        train_loss[it] = solver.net.blobs["loss"].data
        solver.test_nets[0].forward(start="conv1")
        output[it] = solver.test_nets[0].blobs["score"].data[:8]
    assert solver.iter == niter
    correct = 0
    for test_it in range(2):   # the 200 generated test images
        solver.test_nets[0].forward()
        correct += sum(solver.test_nets[0].blobs["score"].data.argmax(1)
                       == solver.test_nets[0].blobs["label"].data)
    assert np.isfinite(train_loss).all() and train_loss[-5:].mean() < train_loss[:5].mean()
    assert correct / 200 > 0.5
    solver.close()


def test_solver_threads_give_the_same_bits(tmp_path, caffe_dir, mnist_dir):
    """cgp's threads= on a pycaffe solver: 1 and 2 workers give bitwise the same weights."""
    path = tutorial_solver(tmp_path, caffe_dir, snapshot=0)
    runs = []
    for threads in (1, 2):
        with caffe.get_solver(path, threads=threads, workers="threads", chunks=8,
                              data_dir=str(mnist_dir)) as solver:
            losses = []
            for _ in range(3):
                solver.step(1)
                losses.append(float(solver.net.blobs["loss"].data))
            runs.append((losses, {k: [b.data.copy() for b in v]
                                  for k, v in solver.net.params.items()}))
    (losses1, params1), (losses2, params2) = runs
    assert losses1 == losses2
    for name in params1:
        for a, b in zip(params1[name], params2[name]):
            assert np.array_equal(a, b)


def test_solver_net_blobs_hold_the_stepped_batch(tmp_path, caffe_dir, mnist_dir):
    """After step(1), solver.net's blobs are that iteration's forward: its batch under the
    weights before the update (their loss is the one the solver reported)."""
    path = tutorial_solver(tmp_path, caffe_dir, snapshot=0)
    with caffe.AdamSolver(path, data_dir=str(mnist_dir), seed=3) as solver:
        solver.step(2)
        before = {k: [b.data.copy() for b in v] for k, v in solver.net.params.items()}
        solver.step(1)
        reported = float(solver.net.blobs["loss"].data)
        score = solver.net.blobs["score"].data.astype(np.float64)
        label = solver.net.blobs["label"].data.astype(int)
        # A fresh net with the weights from before the step reads the same batch (the third).
        net = caffe.Net(str(tmp_path / "mnist/lenet_auto_train.prototxt"), caffe.TRAIN,
                        data_dir=str(mnist_dir))
        for name, blobs in before.items():
            for blob, array in zip(net.params[name], blobs):
                blob.data[...] = array
        for _ in range(3):
            net.forward()
        assert np.array_equal(net.blobs["score"].data, solver.net.blobs["score"].data)
    shifted = score - score.max(1, keepdims=True)
    log_prob = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
    assert -log_prob[np.arange(len(label)), label].mean() == pytest.approx(reported, rel=1e-5)


def test_deploy_net_classifies_with_trained_weights(tmp_path, caffe_dir, mnist_dir):
    """Caffe's example deploy LeNet (an Input layer of 64) with weights from a short
    training: forward a batch, argmax; the same predictions as the TEST net's scores, also
    after reshaping the input to 10 images."""
    path = tmp_path / "lenet_solver.prototxt"    # the bundled LeNet, named as the deploy net
    path.write_text(f'net: "{models.FOLDER / "lenet_train_test.prototxt"}"\n'
                    'base_lr: 0.01 momentum: 0.9 lr_policy: "fixed" random_seed: 1\n'
                    f'snapshot_prefix: "{tmp_path / "lenet"}"\n')
    with caffe.SGDSolver(str(path), data_dir=str(mnist_dir)) as solver:
        solver.step(30)
        weights = solver.snapshot()
        trained = solver.net.params["ip2"][0].data.copy()
    with caffe.SGDSolver(str(path), data_dir=str(mnist_dir)) as again:   # restore()
        again.restore(weights.replace(".caffemodel", ".solverstate"))
        assert again.iter == 30
        assert np.array_equal(again.net.params["ip2"][0].data, trained)
    test = caffe.Net(str(models.FOLDER / "lenet_train_test.prototxt"), caffe.TEST,
                     weights=weights, data_dir=str(mnist_dir))
    scored = test.forward()
    images = test.blobs["data"].data[:64].copy()
    labels = test.blobs["label"].data[:64]
    expected = test.blobs["ip2"].data[:64].argmax(1)
    net = caffe.Net(str(caffe_dir / "prototxt/lenet.prototxt"), weights, caffe.TEST)
    assert net.inputs == ["data"] and net.outputs == ["prob"]
    prob = net.forward(data=images)["prob"]
    assert prob.shape == (64, 10) and np.allclose(prob.sum(1), 1, atol=1e-5)
    assert np.array_equal(prob.argmax(1), expected)
    assert (prob.argmax(1) == labels).mean() > 0.9 and scored["accuracy"] > 0.9
    net.blobs["data"].reshape(10, 1, 28, 28)
    net.reshape()
    assert net.blobs["prob"].data.shape == (10, 10)
    assert np.array_equal(net.forward(data=images[:10])["prob"].argmax(1), expected[:10])
    net.save(tmp_path / "again.caffemodel")
    again = caffe.Net(str(caffe_dir / "prototxt/lenet.prototxt"), caffe.TEST,
                      weights=str(tmp_path / "again.caffemodel"))
    assert np.array_equal(again.params["ip2"][0].data, net.params["ip2"][0].data)


def test_backward_gives_the_gradient_of_a_small_net(tmp_path):
    """net.backward(): the loss's gradient in the parameter and input diffs, against float64
    NumPy (InnerProduct then SoftmaxWithLoss; force_backward reaches the input)."""
    n = caffe.NetSpec()
    n.x, n.y = L.Input(shape=[dict(dim=[5, 3]), dict(dim=[5])], ntop=2)
    n.ip = L.InnerProduct(n.x, num_output=4, weight_filler=dict(type="gaussian", std=0.5),
                          bias_filler=dict(type="gaussian", std=0.5))
    n.loss = L.SoftmaxWithLoss(n.ip, n.y)
    proto = n.to_proto()
    proto.force_backward = True
    path = tmp_path / "net.prototxt"
    path.write_text(str(proto))
    net = caffe.Net(str(path), caffe.TRAIN)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    y = np.array([0, 3, 1, 1, 2], np.float32)
    net.forward(x=x, y=y)
    diffs = net.backward()
    w, b = (p.data.astype(np.float64) for p in net.params["ip"])
    z = x @ w.T + b
    prob = np.exp(z - z.max(1, keepdims=True))
    prob /= prob.sum(1, keepdims=True)
    dz = prob.copy()
    dz[np.arange(5), y.astype(int)] -= 1
    dz /= 5
    assert float(net.blobs["loss"].data) == pytest.approx(
        -np.log(prob[np.arange(5), y.astype(int)]).mean(), rel=1e-6)
    np.testing.assert_allclose(net.params["ip"][0].diff, dz.T @ x, atol=1e-6)
    np.testing.assert_allclose(net.params["ip"][1].diff, dz.sum(0), atol=1e-6)
    np.testing.assert_allclose(diffs["x"], dz @ w, atol=1e-6)
    net.backward()   # cleared first: the same diffs, not twice them
    np.testing.assert_allclose(net.params["ip"][1].diff, dz.sum(0), atol=1e-6)


def test_transformer_round_trip():
    rng = np.random.default_rng(1)
    image = rng.random((8, 10, 3)).astype(np.float32)          # H, W, RGB in [0, 1]
    t = caffe.io.Transformer({"data": (1, 3, 8, 10)})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    t.set_mean("data", np.array([104.0, 117.0, 123.0]))
    t.set_input_scale("data", 0.5)
    x = t.preprocess("data", image)
    expected = (image.transpose(2, 0, 1)[::-1] * 255 - np.array([104, 117, 123])[:, None, None]) * 0.5
    np.testing.assert_allclose(x, expected, rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(t.deprocess("data", x), image, atol=1e-5)
    with pytest.raises(CgpError, match="3 channels"):
        t.set_mean("data", np.zeros(4))


def test_load_and_resize_image(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    pixels = np.random.default_rng(2).integers(0, 256, (6, 7, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "x.png")
    image = caffe.io.load_image(str(tmp_path / "x.png"))
    assert image.shape == (6, 7, 3) and image.dtype == np.float32
    np.testing.assert_allclose(image, pixels / 255, atol=1e-6)
    assert caffe.io.load_image(str(tmp_path / "x.png"), color=False).shape == (6, 7, 1)
    t = caffe.io.Transformer({"data": (1, 3, 12, 14)})
    t.set_transpose("data", (2, 0, 1))
    assert t.preprocess("data", image).shape == (3, 12, 14)   # resized to the input


def test_unsupported_pycaffe_names_say_so(caffe_dir):
    for name in ("Classifier", "set_random_seed", "Timer"):
        with pytest.raises(caffe.PycaffeUnsupported, match=f"caffe.{name} is not supported"):
            getattr(caffe, name)
        assert not hasattr(caffe, name)
    net = caffe.Net(str(caffe_dir / "prototxt/lenet.prototxt"), caffe.TEST)
    with pytest.raises(caffe.PycaffeUnsupported, match="Net.forward_backward_all"):
        net.forward_backward_all
    with pytest.raises(AttributeError, match="no attribute 'frobnicate'"):
        caffe.frobnicate


def test_import_cgp_stays_light():
    """The pycaffe names load on first use: `import cgp` imports neither NumPy nor them."""
    code = ("import sys, cgp; print('numpy' in sys.modules, 'cgp.caffe.pycaffe' in sys.modules); "
            "cgp.TEST; print('cgp.caffe.pycaffe' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False", "True"]
