"""pycaffe's caffe.draw and `cgp draw`: a NetParameter as a Graphviz graph, layers as boxes and
blobs as octagons, as Caffe's draw_net.py draws it.

The graph's dot text is made here, with no extra package; PNG, SVG, PDF (any format but
dot) are made by Graphviz's `dot` program, which must be on PATH (apt-get install graphviz).
get_pydot_graph needs pydot (pip install pydot).
"""
import shutil
import subprocess

from cgp.errors import CgpError, shorten
from cgp.proto import caffe_pb2

LAYER_STYLE = {"shape": "record", "fillcolor": "#6495ED", "style": "filled"}
NEURON_LAYER_STYLE = {"shape": "record", "fillcolor": "#90EE90", "style": "filled"}
BLOB_STYLE = {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}
TEXT_FORMATS = ("dot", "gv", "raw", "canon")   # written as the dot text itself


def _quote(text, record=False):
    """text as a dot string; record: a record shape's label, whose {}|<> are fields."""
    text = str(text).replace("\\", "\\\\").replace('"', '\\"')
    if record:
        for c in "{}|<>":
            text = text.replace(c, "\\" + c)
    return '"' + text.replace("\n", "\\n") + '"'


def _attributes(style, **more):
    items = {**style, **more}
    record = items.get("shape") == "record"
    return "[" + ", ".join(f"{k}={_quote(v, record and k == 'label')}"
                           for k, v in items.items()) + "]"


def _layers(net):
    """(name, type name, bottoms, tops, LayerParameter) of each layer, new format or V1."""
    for lp in net.layer:
        yield lp.name, lp.type, list(lp.bottom), list(lp.top), lp
    for lp in net.layers:
        yield lp.name, caffe_pb2.V1LayerParameter.LayerType.Name(lp.type), list(lp.bottom), \
            list(lp.top), lp


def _in_phase(lp, phase):
    """Whether the layer is in `phase` (caffe_pb2.TRAIN or TEST) by its include/exclude
    rules' phases; every layer where phase is None."""
    if phase is None:
        return True
    if lp.include and lp.exclude:
        raise CgpError(f"layer '{shorten(lp.name)}': give include or exclude rules, not both")
    if lp.include:
        return any(not r.HasField("phase") or r.phase == phase for r in lp.include)
    return not any(r.HasField("phase") and r.phase == phase for r in lp.exclude)


def _sizes(values, default=None):
    values = list(values) if not isinstance(values, int) else [values]
    return "x".join(str(v) for v in values) if values else default


def layer_label(name, type_name, lp, rankdir):
    """The box's text: name and type, with a convolution's or pooling's kernel, stride and
    pad; one line each ("|" separates a record's fields across the layout's direction)."""
    sep = "\n" if rankdir in ("LR", "RL") else " "
    label = f"{name}{sep}({type_name})"
    if type_name in ("Convolution", "Deconvolution") and hasattr(lp, "convolution_param"):
        cp = lp.convolution_param
        label += (f"{sep}kernel size: {_sizes(cp.kernel_size, cp.kernel_h or 1)}{sep}"
                  f"stride: {_sizes(cp.stride, cp.stride_h or 1)}{sep}"
                  f"pad: {_sizes(cp.pad, cp.pad_h or 0)}")
    elif type_name == "Pooling" and hasattr(lp, "pooling_param"):
        pp = lp.pooling_param
        label += (f"{sep}pool: {caffe_pb2.PoolingParameter.PoolMethod.Name(pp.pool)}{sep}"
                  f"kernel size: {pp.kernel_size or pp.kernel_h}{sep}"
                  f"stride: {pp.stride}{sep}pad: {pp.pad}")
    return label


def dot_source(caffe_net, rankdir="LR", phase=None, display_lrm=False):
    """The net as Graphviz dot text. phase: caffe_pb2.TRAIN or TEST to draw that phase's
    layers alone; display_lrm: the layers' learning-rate multipliers in their boxes."""
    lines = [f"digraph {_quote(caffe_net.name or 'net')} {{", f"rankdir={_quote(rankdir)};"]
    edges = []
    for index, (name, type_name, bottoms, tops, lp) in enumerate(_layers(caffe_net)):
        if not _in_phase(lp, phase):
            continue
        node = f"layer{index}"
        label = layer_label(name, type_name, lp, rankdir)
        if display_lrm and lp.param:
            label += "\nlr mult: " + ", ".join(f"{p.lr_mult:g}" for p in lp.param)
        in_place = len(bottoms) == 1 and bottoms == tops
        style = NEURON_LAYER_STYLE if in_place else LAYER_STYLE
        lines.append(f"{node} {_attributes(style, label=label)};")
        for blob in bottoms:
            edges.append((f"blob_{blob}", node))
        for blob in tops:
            edges.append((node, f"blob_{blob}"))
    blobs = {n for edge in edges for n in edge if n.startswith("blob_")}
    for blob in sorted(blobs):
        lines.append(f"{_quote(blob)} {_attributes(BLOB_STYLE, label=blob[len('blob_'):])};")
    for a, b in edges:
        a, b = (_quote(n) if n.startswith("blob_") else n for n in (a, b))
        lines.append(f"{a} -> {b};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def get_pydot_graph(caffe_net, rankdir="LR", label_edges=True, phase=None, display_lrm=False):
    """The graph as a pydot.Dot (needs pydot)."""
    try:
        import pydot
    except ImportError:
        raise CgpError("caffe.draw.get_pydot_graph needs pydot: pip install pydot (draw_net "
                       "and dot_source do not)") from None
    return pydot.graph_from_dot_data(dot_source(caffe_net, rankdir, phase, display_lrm))[0]


def draw_net(caffe_net, rankdir="LR", ext="png", phase=None, display_lrm=False):
    """The net drawn in format `ext` (png, svg, pdf, ...: Graphviz's dot program; dot, gv,
    raw: the dot text), as bytes."""
    source = dot_source(caffe_net, rankdir, phase, display_lrm)
    if ext in TEXT_FORMATS:
        return source.encode()
    program = shutil.which("dot")
    if program is None:
        raise CgpError(f"drawing a net as {ext} needs Graphviz's `dot` program (apt-get "
                       "install graphviz); a .dot file needs nothing")
    run = subprocess.run([program, f"-T{ext}"], input=source.encode(), capture_output=True)
    if run.returncode != 0:
        raise CgpError(f"Graphviz's dot -T{ext} failed: "
                       f"{shorten(run.stderr.decode(errors='replace').strip(), 500)}")
    return run.stdout


def draw_net_to_file(caffe_net, filename, rankdir="LR", phase=None, display_lrm=False):
    """Writes the drawing to filename, in the format its extension names."""
    ext = str(filename).rsplit(".", 1)[-1] if "." in str(filename) else "png"
    data = draw_net(caffe_net, rankdir, ext, phase, display_lrm)
    with open(filename, "wb") as f:
        f.write(data)


def draw_prototxt(model, out, rankdir="LR", phase="ALL", display_lrm=False):
    """`cgp draw`: the net prototxt `model` drawn into `out`."""
    from cgp.prototxt import read_model
    phases = {"ALL": None, "TRAIN": caffe_pb2.TRAIN, "TEST": caffe_pb2.TEST}
    draw_net_to_file(read_model(model), out, rankdir, phases[phase], display_lrm)
