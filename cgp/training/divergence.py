"""What a training step that found a value not finite (cgp.step.Diverged) tells the user:
the iteration, and where the first such value appeared. It runs once, after the step has
raised, on the weights the step left; the step itself checks and nothing more."""
import numpy as np

from cgp.layers import Chunk
from cgp.net import Workspace
from cgp.runtime.update import all_finite


def explain(d, net, seed, position, iteration):
    """The message for Diverged d of train net `net`: where the value first appeared: the
    first layer whose output is not finite (the loss; a forward pass of that batch, at record
    `position` with data iteration `iteration`, on the weights before the step, which the
    step left), or the parameter blob whose update went infinite or NaN (its gradient)."""
    if d.column is not None:
        blob = next(b for b in net.param_blobs
                    if b.offset <= d.column < b.offset + b.size)
        where = (f"the gradient of layer '{blob.layer}' blob {blob.index} {blob.shape} is not "
                 "finite, and so are weights its update wrote")
    else:
        where = (f"the loss is {d.loss:g}" if d.loss is not None else "the loss is not finite")
        where += f" ({first_not_finite(net, seed, position, iteration)})"
    return (f"training diverged at iteration {d.iteration}: {where}. Training stopped; no "
            "snapshot was written of these weights (the last snapshot, if any, is intact). "
            "A smaller base_lr, clip_gradients or finite input data may help")


def first_not_finite(net, seed, position, iteration):
    """Where a forward pass of the batch at `position`, on one worker and the current
    weights, first gives a value that is not finite."""
    batch = {}
    for entry in net.sources:
        batch.update(zip(entry.tops, entry.layer.load(position, iteration, seed)))
        for name, top in zip(entry.layer.lp.top, entry.tops):
            if not all_finite(np.asarray(batch[top])):
                return f"the data of layer '{entry.layer.name}', top '{name}', is not finite"
    ws = Workspace(net, net.batch_size, with_diff=False)
    chunk = Chunk(n=net.batch_size, batch=net.batch_size, iteration=iteration,
                  seed=seed, batch_tops=net.batch_tops(batch))
    params = net.param_views(net.params)
    data = net.forward(ws, chunk, batch, params)
    for entry, views in zip(net.entries, params):
        if any(not all_finite(data[t]) for t in entry.tops):
            bad = [i for i, v in enumerate(views) if not all_finite(v)]
            cause = (f"its blob(s) {', '.join(map(str, bad))} hold non-finite weights" if bad
                     else "its input and weights are finite")
            return (f"the first output that is not finite is layer '{entry.layer.name}' "
                    f"({entry.layer.type_name})'s: {cause}")
    return "a forward pass on one worker gives finite values throughout"
