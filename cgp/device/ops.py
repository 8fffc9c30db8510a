"""Device ops: the forward and backward of a layer type over the arrays of ONE chunk, written
against an array module `xp` (CuPy on a GPU; NumPy as its stand-in, which is how the tests run
them without a GPU), for the device engine (cgp.device.engine). Each op sits in its layer's
module (cgp/layers/<family>.py), a cgp.layers.DeviceOp registered with @device_op next to the
layer; here is only what every op shares: finding a layer's op, and which layers have none.

An op reads its layer's configuration from the CPU layer object (set up by the net: the
prototxt stays the one source of truth) and never branches on the array module: the backend
hands it `xp`, and only NumPy-API calls that CuPy also has are used. An op keeps the
layer's per-call protocol (cgp.layers.base: Layer.forward, Layer.backward, batch_sums):

    Op(layer, xp)                 (the layer's device_op; cgp.layers.base.DeviceOp the base)
    forward(bottom, top, params, scratch, chunk)
    backward(top, top_diff, bottom, bottom_diff, params, param_diff, scratch, chunk)

with the same meanings: a loss top is a 0-d array, the chunk's share of the batch's loss;
param_diff arrays (this call's own gradient, the blob's shape) are added to; bottom_diff
arrays are overwritten, None where no gradient flows. A layer that sums over the batch
(batch_sums) makes its op's forward (backward) a generator that yields SYNC at each sum,
where the layer's forward_calls (backward_calls) do: before it, the call writes its
parts' shares of sum k into scratch["sums"][k][0], a (parts, m_k) float64 array; the
engine adds every chunk's shares in the fixed tree, the layer's sync() finishes them, and
the calls after read the batch's total, scratch["sums"][k][1] (m_k,), on the device. An op
keeps what its backward reads (max pooling's window offsets, a loss's probabilities)
between the two: each workspace has ops of its own.

Why one chunk: the weights must be bitwise the same for any number of devices or ranks, so
nothing a chunk computes may depend on which other chunks share its call: a library GEMM or
reduction picks its algorithm (and so its order of additions) from the shapes it is given,
and a chunk's shapes are fixed by the batch and the chunk count alone. Every op is
also free of atomics (max-pooling's gradient and col2im add window offset by window offset,
in a fixed order), so the same shapes give the same bits on every run.
"""
def make_op(layer, xp):
    """The layer's device op, on array module xp (a layer with none: see unsupported)."""
    return layer.device_op(layer, xp)


def unsupported(net):
    """[(layer name, type, why), ...] of the net's layers that the device cannot run: those
    with no device op, and those whose op refuses their configuration."""
    out = []
    for entry in net.entries:
        layer = entry.layer
        cls = layer.device_op
        why = "no device op" if cls is None else cls.refuses(layer)
        if why:
            out.append((layer.name, layer.type_name, why))
    return out
