"""`cgp test`: score trained weights on a net's TEST phase, as `caffe test` does.

Batch i reads the records from i * batch_size on (the first batch starts at the first
record), and the lines printed are Caffe's: every scalar output per batch, the mean
loss, then each output's mean (with its loss weight for losses). Not here: training.
"""

import numpy as np
from threadpoolctl import threadpool_limits

from cgp.comm import make_communicator
from cgp.device import check_device, make_engine, select_backend
from cgp.errors import CgpError, shorten
from cgp.net import RunOptions, build_net
from cgp.proto import caffe_pb2
from cgp.runtime.procs import default_workers, make_pool
from cgp.prototxt import read_model
from cgp.snapshot import layers_without, load_weights
from cgp.train import fmt, loss_note

SEED = 1701   # the TEST phase draws nothing random unless mirror is set; fixed, as Caffe's


def load_all_weights(net, names, log):
    """Copy every comma-separated .caffemodel into the net by layer name; logs what it did.
    Weights that leave every layer of the net untouched are refused: the score of such a
    net says nothing (the wrong file, most likely)."""
    copied = []
    for name in names.split(","):
        copied += load_weights(net, name, log)
    missing = layers_without(net, copied)
    if missing and not copied:
        raise CgpError(f"--weights {names}: holds no layer of the net (its layers with "
                       f"weights: {', '.join(missing)})")
    if missing:
        log(f"Warning: no weights for {', '.join(missing)}: scored with zero weights there")


def check_finite(outputs, loss, batch, weights):
    """A score over non-finite outputs means nothing (a NaN is no class): CgpError saying
    which output of which batch, instead of an accuracy."""
    bad = [f"{name} = {fmt(value)}" for name, value in [("loss", loss), *outputs.items()]
           if not np.isfinite(value)]
    if bad:
        raise CgpError(f"batch {batch}: {', '.join(bad)}: the net's outputs are not finite, so "
                       f"there is no score to report; the weights ({shorten(weights)}) or the "
                       "data hold NaN or infinite values, or the net overflows")


def run_test(model, weights, iterations, threads=1, chunks=16, data_dir=None, download=True,
             log=print, flush_denormals=True, workers=None, affinity=False, device="cpu"):
    """Run `iterations` TEST batches; returns ({output: mean}, mean loss). workers, affinity,
    device: as cgp train's (RunConfig; workers None: procs.default_workers())."""
    if iterations < 1:
        raise CgpError(f"--iterations must be at least 1, got {iterations}")
    check_device(device, threads)
    net = build_net(read_model(model), model, caffe_pb2.TEST, RunOptions(data_dir, download))
    load_all_weights(net, weights, log)
    backend = select_backend(device)
    workers = "threads" if backend is not None else workers or default_workers()
    pool = make_pool(workers, threads, [net], affinity, flush_denormals)
    try:
        engine = make_engine(backend, net, chunks, pool, make_communicator(pool), backward=False)
        pool.start()
        if not engine.tracked:
            raise CgpError(f"model {model}: the TEST net has no scalar outputs (loss, accuracy) "
                           "to score")
        # Caffe sums the scores and the loss in float.
        sums = {name: np.float32(0) for _, name in engine.tracked}
        loss_sum = np.float32(0)
        log(f"Running for {iterations} iterations.")
        with threadpool_limits(limits=1):
            for i in range(iterations):
                batch = {}
                for entry in net.sources:
                    tops = entry.layer.load(i * net.batch_size, i, SEED)
                    batch.update(zip(entry.tops, tops))
                outputs, loss, _ = engine.run(batch, i, SEED)
                loss_sum += np.float32(loss)
                for name, value in outputs.items():
                    sums[name] += np.float32(value)
                    log(f"Batch {i}, {name} = {fmt(value)}")
                check_finite(outputs, loss, i, weights)
    finally:
        pool.close()
        for entry in net.sources:
            if hasattr(entry.layer, "close"):
                entry.layer.close()
    mean_loss = float(loss_sum / np.float32(iterations))
    log(f"Loss: {fmt(mean_loss)}")
    means = {}
    for name, total in sums.items():
        means[name] = float(total / np.float32(iterations))
        log(f"{name} = {fmt(means[name])}{loss_note(net, name, means[name])}")
    return means, mean_loss
