"""A net prototxt made into a training that `cgp bench speedup --model FILE` can time: its
batch set by --batch, a loss where a deploy net has none, synthetic input for its Input
layers, and a fixed SGD solver around it. cgp and the PyTorch copy (cgp.tools.torch_ref) both
train the net this makes, so they do the same work. Times nothing itself.

Convolutions and inner products that name no weight_filler (a deploy net's, whose weights
come from a .caffemodel) start from MSRA's filler rather than Caffe's default zeros.
A deploy net (no loss) becomes the net it would train as: each output that a Softmax layer
makes becomes SoftmaxWithLoss against synthetic labels (the train_val nets' loss); any other
output gets a loss that sums it (Reduction SUM over the batch: a gradient of ones, as
`cgp time` uses); BatchNorm layers that a deploy file sets to use_global_stats compute batch
statistics, as in training. A net with a loss is trained as it is.
"""
from pathlib import Path

from cgp.errors import CgpError, shorten
from cgp.proto import caffe_pb2

# The source layers' parameters whose batch_size --batch sets (Input layers: their shapes).
BATCH_FIELDS = ("data_param", "image_data_param", "hdf5_data_param", "window_data_param",
                "memory_data_param")

# The layers whose weights with_fillers fills, and their parameter field.
FILLED = {"Convolution": "convolution_param", "Deconvolution": "convolution_param",
          "InnerProduct": "inner_product_param"}

# The solver around a --model net: plain momentum SGD at a fixed, small rate (the rate
# changes no amount of work; a small one keeps a few dozen steps from random weights finite).
BASE_LR, MOMENTUM, WEIGHT_DECAY = 0.001, 0.9, 0.0005

# Stems of net files too common to name a run by: the folder's name goes before them.
GENERIC_STEMS = ("deploy", "train", "train_val", "trainval", "train_test")


def with_batch(param, batch, path):
    """param (a NetParameter, changed in place) with the batch axis of every Input shape and
    every source layer's batch_size set to `batch`; CgpError where a source has none."""
    if batch < 1:
        raise CgpError(f"--batch must be at least 1, got {batch}")
    for lp in param.layer:
        if lp.type == "Input":
            for shape in lp.input_param.shape:
                if not shape.dim:
                    raise CgpError(f"{shorten(path)}: layer '{shorten(lp.name)}': an empty "
                                   "input shape has no batch axis for --batch")
                shape.dim[0] = batch
            continue
        fields = [f for f in BATCH_FIELDS if lp.HasField(f)]
        for field in fields:
            getattr(lp, field).batch_size = batch
        if not fields and not lp.bottom:
            raise CgpError(f"{shorten(path)}: layer '{shorten(lp.name)}' ({lp.type}) makes "
                           "data whose batch --batch cannot set (it sets Input shapes and "
                           f"the batch_size of {', '.join(BATCH_FIELDS)})")
    return param


def with_fillers(param):
    """param (a NetParameter, changed in place) with an MSRA weight_filler on every
    convolution and inner product that names none: a deploy net leaves its weights to a
    .caffemodel, and Caffe's default filler (constant 0) would time a net of zeros. Returns
    how many it set."""
    count = 0
    for lp in param.layer:
        field = FILLED.get(lp.type)
        if field is not None and not getattr(lp, field).HasField("weight_filler"):
            getattr(lp, field).weight_filler.type = "msra"
            count += 1
    return count


def outputs(net):
    """The entries' tops that no entry reads: (blob id, the entry that writes it)."""
    read = {b for e in net.entries for b in e.bottoms}
    return [(t, e) for e in net.entries for t in e.tops if t not in read]


def with_loss(param, net, path):
    """param (a NetParameter, changed in place) made a training net when `net`, the net built
    from it, has no loss (see the module's note); returns lines that say what changed."""
    if net.loss_weights:
        return []
    said = []
    layers = {lp.name: lp for lp in param.layer}
    labels = []
    for blob, entry in outputs(net):
        lp = layers[entry.layer.name]
        if lp.type == "Softmax":
            shape = net.blob_shapes[entry.bottoms[0]]
            axis = entry.layer.axis
            label = f"{lp.top[0]}_bench_label"
            labels.append((label, shape[:axis] + shape[axis + 1:]))
            lp.type = "SoftmaxWithLoss"
            lp.bottom.append(label)
            said.append(f"'{lp.name}' Softmax -> SoftmaxWithLoss against synthetic labels")
        else:
            name = net.blob_names[blob]
            loss = param.layer.add(name=f"{name}_bench_loss", type="Reduction", bottom=[name],
                                   top=[f"{name}_bench_loss"], loss_weight=[1.0])
            loss.reduction_param.operation = caffe_pb2.ReductionParameter.SUM
            said.append(f"'{name}' summed as the loss (Reduction SUM)")
    if not said:
        raise CgpError(f"{shorten(path)}: the net has no loss and no output to put one on")
    for k, (label, shape) in enumerate(labels):
        source = caffe_pb2.LayerParameter(name=f"bench_label_{k}", type="Input", top=[label])
        source.input_param.shape.add().dim.extend(shape)
        param.layer.insert(0, source)
    frozen = [lp for lp in param.layer if lp.type == "BatchNorm"
              and lp.batch_norm_param.HasField("use_global_stats")]
    for lp in frozen:
        lp.batch_norm_param.ClearField("use_global_stats")
    if frozen:
        said.append(f"{len(frozen)} BatchNorm layer(s) with batch statistics (use_global_stats "
                    "cleared)")
    return said


def bench_solver(path, batch=None, options=None, log=print):
    """The SolverParameter that `--model path` trains: the net as above, plain SGD (BASE_LR,
    MOMENTUM, WEIGHT_DECAY, lr_policy fixed), no tests, no snapshots."""
    from cgp.net import RunOptions, build_net
    from cgp.prototxt import read_model

    param = read_model(path, log)
    if batch is not None:
        with_batch(param, batch, path)
    filled = with_fillers(param)
    if filled:
        log(f"cgp bench: {filled} convolution and inner-product layer(s) of {shorten(path)} "
            "name no weight_filler (Caffe's default: zeros); they start from MSRA's instead")
    options = options or RunOptions()
    net = build_net(param, path, caffe_pb2.TRAIN, options)
    said = with_loss(param, net, path)
    if said:
        log(f"cgp bench: {shorten(path)} has no loss; timed as a training net, in cgp and "
            f"PyTorch alike: {'; '.join(said)}")
        build_net(param, path, caffe_pb2.TRAIN, options)   # what was added checks as well
    sp = caffe_pb2.SolverParameter(base_lr=BASE_LR, lr_policy="fixed", momentum=MOMENTUM,
                                   weight_decay=WEIGHT_DECAY, type="SGD", max_iter=1 << 30,
                                   display=0)
    sp.net_param.CopyFrom(param)
    return sp


def run_name(path):
    """What a run of the net file is called in the result files' names."""
    p = Path(path)
    return f"{p.parent.name}_{p.stem}" if p.stem in GENERIC_STEMS and p.parent.name else p.stem
