"""SHA-256 of a net's forward and backward on fixed input (issue 53, opt level): two
iterations of `cgp time`'s LayerTimer (seed 1, random Input data, a gradient of ones on the
outputs of a deploy net), hashing the last call's parameter gradients and every blob's data
and diff. Run it under two settings (NUMBA_OPT, each with its own NUMBA_CACHE_DIR) and
compare the lines.

    python bench/net_hash.py MODEL.prototxt [BATCH]
"""
import hashlib
import sys

import numpy as np
from threadpoolctl import threadpool_limits

from cgp.commands.timing import LayerTimer, fill_inputs
from cgp.net import RunOptions, build_net
from cgp.proto import caffe_pb2
from cgp.prototxt import read_model


def main(path, batch):
    param = read_model(path)
    # The batch size, in whichever of Caffe's input forms the net uses.
    if param.input_dim:
        param.input_dim[0] = batch
    for shape in list(param.input_shape) + [s for lp in param.layer
                                            for s in lp.input_param.shape]:
        shape.dim[0] = batch
    net = build_net(param, path, caffe_pb2.TRAIN, RunOptions(None, False))
    net.init_params(1)
    fill_inputs(net, 1)
    timer = LayerTimer(net, 4, 1)
    with threadpool_limits(limits=1):
        timer.iteration(0)
        timer.iteration(1)
    digest = hashlib.sha256(np.ascontiguousarray(timer.grads).tobytes())
    for a in list(timer.ws.data) + list(timer.ws.diff or []):
        if a is not None:
            digest.update(np.ascontiguousarray(a).tobytes())
    print(f"{path}: batch {batch}, parameter gradients "
          f"{hashlib.sha256(timer.grads.tobytes()).hexdigest()[:16]}, all "
          f"{digest.hexdigest()[:16]}, non-zero gradients {np.count_nonzero(timer.grads)}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4)
