"""Caffe's upgrades of deprecated net definitions, as its UpgradeNetAsNeeded applies them on
load: the V1 format (`layers { type: CONVOLUTION blobs_lr: 1 ... }`) with the old places of
V1 data layers' transformation fields, the legacy top-level `input:` / `input_dim:` /
`input_shape {}` fields, and BatchNorm layers' old three param specs.

It rewrites NetParameter messages only; it neither reads files nor builds nets. The still
older V0 format (`layers { layer { ... } }`) is refused with a pointer to Caffe's tool.
"""
from cgp.errors import PrototxtError, shorten
from cgp.proto import caffe_pb2

V1 = caffe_pb2.V1LayerParameter

# Caffe's UpgradeV1LayerType: each V1 enum type and the type string that replaced it.
V1_TYPES = {
    V1.ABSVAL: "AbsVal", V1.ACCURACY: "Accuracy", V1.ARGMAX: "ArgMax", V1.BNLL: "BNLL",
    V1.CONCAT: "Concat", V1.CONTRASTIVE_LOSS: "ContrastiveLoss",
    V1.CONVOLUTION: "Convolution", V1.DECONVOLUTION: "Deconvolution", V1.DATA: "Data",
    V1.DROPOUT: "Dropout", V1.DUMMY_DATA: "DummyData", V1.EUCLIDEAN_LOSS: "EuclideanLoss",
    V1.ELTWISE: "Eltwise", V1.EXP: "Exp", V1.FLATTEN: "Flatten", V1.HDF5_DATA: "HDF5Data",
    V1.HDF5_OUTPUT: "HDF5Output", V1.HINGE_LOSS: "HingeLoss", V1.IM2COL: "Im2col",
    V1.IMAGE_DATA: "ImageData", V1.INFOGAIN_LOSS: "InfogainLoss",
    V1.INNER_PRODUCT: "InnerProduct", V1.LRN: "LRN", V1.MEMORY_DATA: "MemoryData",
    V1.MULTINOMIAL_LOGISTIC_LOSS: "MultinomialLogisticLoss", V1.MVN: "MVN",
    V1.POOLING: "Pooling", V1.POWER: "Power", V1.RELU: "ReLU", V1.SIGMOID: "Sigmoid",
    V1.SIGMOID_CROSS_ENTROPY_LOSS: "SigmoidCrossEntropyLoss", V1.SILENCE: "Silence",
    V1.SOFTMAX: "Softmax", V1.SOFTMAX_LOSS: "SoftmaxWithLoss", V1.SPLIT: "Split",
    V1.SLICE: "Slice", V1.TANH: "TanH", V1.WINDOW_DATA: "WindowData",
    V1.THRESHOLD: "Threshold",
}

# The V1 data layers whose own parameter message once held the transformation fields
# (Caffe's UpgradeNetDataTransformation), and those fields.
DATA_PARAMS = {V1.DATA: "data_param", V1.IMAGE_DATA: "image_data_param",
               V1.WINDOW_DATA: "window_data_param"}
TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")

# Repeated V1 fields that Caffe's UpgradeV1LayerParameter carries over under the same name,
# besides `name` and every `*_param` message (all of them are LayerParameter's too).
SAME_FIELDS = ("bottom", "top", "include", "exclude", "blobs", "loss_weight")


def upgrade_net(net, where):
    """Upgrade `net` (a NetParameter) in place as Caffe's UpgradeNetAsNeeded does. Returns
    the upgrades made, in words (empty if none), for the caller's one note; where: the file
    (or solver field) the net came from, for errors."""
    done = []
    if net.layers:
        upgrade_v1(net, where)
        done.append("V1 layers (layers { type: ENUM }) to layer { type: \"Name\" }")
    if net.input:
        upgrade_input(net, where)
        done.append("the input fields to an Input layer 'input'")
    if upgrade_batch_norm(net):
        done.append("BatchNorm's three param specs to lr_mult 0 and decay_mult 0")
    return done


def note(done, where):
    """The one line that says what upgrade_net did."""
    return (f"Note: {where} is in Caffe's deprecated net format; upgraded as Caffe does on "
            f"load: {', '.join(done)} (upgrade_net_proto_text writes the new format)")


def upgrade_v1(net, where):
    """Caffe's UpgradeNetDataTransformation and UpgradeV1Net: each `layers` entry becomes a
    `layer` with its type's name, blobs_lr / weight_decay / param / blob_share_mode as
    ParamSpecs, and its parameter messages carried over."""
    if net.layer:
        raise PrototxtError(f"{where}: the net has both 'layer' and 'layers' (V1) entries; "
                            "Caffe refuses such a file too: write every layer in one format")
    if any(v1.HasField("layer") for v1 in net.layers):
        raise PrototxtError(f"{where}: the net uses Caffe's V0 format (layers {{ layer {{ ... "
                            "} }), older than V1, which cgp does not upgrade: convert it with "
                            "Caffe's upgrade_net_proto_text OLD.prototxt NEW.prototxt")
    params = [f.name for f in V1.DESCRIPTOR.fields if f.name.endswith("_param")]
    for index, v1 in enumerate(net.layers):
        lp = net.layer.add()
        if v1.HasField("name"):
            lp.name = v1.name
        for name in SAME_FIELDS:
            getattr(lp, name).extend(getattr(v1, name))
        if v1.HasField("type"):
            if v1.type == V1.NONE:
                raise PrototxtError(f"{where}: V1 layer {index} ('{shorten(v1.name)}') has "
                                    "type NONE")
            lp.type = V1_TYPES[v1.type]
        _move_transform_fields(v1)
        for name in params:
            if v1.HasField(name):
                getattr(lp, name).CopyFrom(getattr(v1, name))
        _param_specs(v1, lp)
    net.ClearField("layers")


def _move_transform_fields(v1):
    """Caffe's UpgradeNetDataTransformation, on one V1 layer: scale, mean_file, crop_size
    and mirror move from a data layer's own message into transform_param."""
    field = DATA_PARAMS.get(v1.type)
    if field is None or not v1.HasField(field):
        return
    old = getattr(v1, field)
    for name in TRANSFORM_FIELDS:
        if old.HasField(name):
            setattr(v1.transform_param, name, getattr(old, name))
            old.ClearField(name)


def _param_specs(v1, lp):
    """The V1 per-blob lists (param names, blob_share_mode, blobs_lr, weight_decay) as one
    ParamSpec per blob, as many as the longest list."""
    count = max(len(v1.param), len(v1.blob_share_mode), len(v1.blobs_lr), len(v1.weight_decay))
    for _ in range(count):
        lp.param.add()
    for spec, name in zip(lp.param, v1.param):
        spec.name = name
    for spec, mode in zip(lp.param, v1.blob_share_mode):
        spec.share_mode = mode      # the two DimCheckMode enums number alike
    for spec, lr in zip(lp.param, v1.blobs_lr):
        spec.lr_mult = lr
    for spec, decay in zip(lp.param, v1.weight_decay):
        spec.decay_mult = decay


def upgrade_input(net, where):
    """Caffe's UpgradeNetInput: the top-level input names with their input_shape (or 4
    input_dim values each) become one Input layer named 'input', put first."""
    names = list(net.input)
    if net.input_shape:
        if len(net.input_shape) != len(names):
            raise PrototxtError(f"{where}: {len(names)} input fields but "
                                f"{len(net.input_shape)} input_shape entries: give one each")
        shapes = [list(s.dim) for s in net.input_shape]
    elif net.input_dim:
        if len(net.input_dim) != 4 * len(names):
            raise PrototxtError(f"{where}: {len(names)} input fields but {len(net.input_dim)} "
                                "input_dim values: give 4 (num, channels, height, width) each")
        dims = list(net.input_dim)
        shapes = [dims[4 * i:4 * i + 4] for i in range(len(names))]
    else:
        # Caffe strips a bare `input:` (a legacy .caffemodel's); a net file needs the shapes.
        raise PrototxtError(f"{where}: input '{shorten(names[0])}' has no input_shape or "
                            "input_dim; give its shape (or declare an Input layer)")
    layer = caffe_pb2.LayerParameter(name="input", type="Input", top=names)
    for dims in shapes:
        layer.input_param.shape.add().dim.extend(dims)
    rest = list(net.layer)
    del net.layer[:]
    net.layer.append(layer)
    net.layer.extend(rest)
    for name in ("input", "input_shape", "input_dim"):
        net.ClearField(name)


def upgrade_batch_norm(net):
    """Caffe's UpgradeNetBatchNorm: a BatchNorm layer with three param specs (the old way to
    keep its statistics from the solver) gets lr_mult 0 and decay_mult 0 on each. Returns
    whether that changed what the solver does (an lr_mult that was not 0)."""
    changed = False
    for lp in net.layer:
        if lp.type == "BatchNorm" and len(lp.param) == 3:
            for spec in lp.param:
                changed = changed or spec.lr_mult != 0
                spec.lr_mult, spec.decay_mult = 0, 0
    return changed
