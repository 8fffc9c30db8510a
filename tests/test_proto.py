"""caffe.proto matches Caffe's schema; prototxt and Caffe's binary snapshots read correctly."""

import filecmp
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, unknown_fields

from cgp.errors import PrototxtError
from cgp.proto import caffe_pb2, cgp_pb2
from cgp.prototxt import format_message, parse_net, parse_solver, read_net, read_solver

# schema_facts() of the caffe_pb2 module generated from BVLC Caffe's own src/caffe/proto/caffe.proto
# at commit 9b891540 (the commit that wrote the files under shared/data/caffe).
CAFFE_SCHEMA_SHA256 = "a63978b030c17d3daf2da571b1b74b584b852161411e66fea3c7a64139a87b9a"


def schema_facts(file_descriptor):
    """One sorted line per field and enum: everything the wire and text formats depend on."""
    fdp = descriptor_pb2.FileDescriptorProto()
    file_descriptor.CopyToProto(fdp)
    lines = []

    def enums(enum_types, prefix):
        for e in enum_types:
            values = " ".join(f"{v.name}={v.number}" for v in e.value)
            lines.append(f"enum {prefix}{e.name}: {values}")

    def messages(message_types, prefix):
        for m in message_types:
            for f in m.field:
                lines.append(f"{prefix}{m.name}.{f.name} = {f.number} label={f.label} type={f.type} "
                             f"{f.type_name} default={f.default_value!r} packed={f.options.packed}")
            enums(m.enum_type, f"{prefix}{m.name}.")
            messages(m.nested_type, f"{prefix}{m.name}.")

    messages(fdp.message_type, f"{fdp.package}.")
    enums(fdp.enum_type, f"{fdp.package}.")
    return sorted(lines)


def test_schema_is_caffes():
    facts = "\n".join(schema_facts(caffe_pb2.DESCRIPTOR))
    assert hashlib.sha256(facts.encode()).hexdigest() == CAFFE_SCHEMA_SHA256, (
        "caffe.proto no longer matches Caffe's schema (field numbers, types, labels or defaults)")


@pytest.mark.parametrize("module", [caffe_pb2, cgp_pb2], ids=["caffe_pb2", "cgp_pb2"])
def test_generated_module_is_reproducible(tmp_path, module):
    pytest.importorskip("grpc_tools")
    subprocess.run([sys.executable, "-m", "cgp.proto.generate", str(tmp_path)], check=True,
                   capture_output=True)
    fresh = tmp_path / Path(module.__file__).name
    assert filecmp.cmp(fresh, module.__file__, shallow=False), (
        f"cgp/proto/{fresh.name} is stale: run python -m cgp.proto.generate")
    assert str(tmp_path) not in fresh.read_text()


def test_defaults():
    assert caffe_pb2.ConvolutionParameter().bias_term is True
    assert caffe_pb2.ConvolutionParameter().group == 1
    assert caffe_pb2.PoolingParameter().pool == caffe_pb2.PoolingParameter.MAX
    assert caffe_pb2.PoolingParameter().stride == 1
    assert caffe_pb2.PoolingParameter().round_mode == caffe_pb2.PoolingParameter.CEIL
    lrn = caffe_pb2.LRNParameter()
    assert (lrn.local_size, lrn.alpha, lrn.beta, lrn.k) == (5, 1.0, 0.75, 1.0)
    assert caffe_pb2.LossParameter().normalization == caffe_pb2.LossParameter.VALID
    assert caffe_pb2.FillerParameter().type == "constant"
    assert caffe_pb2.ParamSpec().lr_mult == 1.0
    assert caffe_pb2.NetState().phase == caffe_pb2.TEST
    solver = caffe_pb2.SolverParameter()
    assert solver.type == "SGD"
    assert solver.momentum2 == pytest.approx(0.999)
    assert solver.delta == pytest.approx(1e-8)
    assert solver.rms_decay == pytest.approx(0.99)
    assert solver.random_seed == -1
    assert solver.regularization_type == "L2"
    assert solver.clip_gradients == -1
    assert solver.iter_size == 1 and solver.average_loss == 1
    assert solver.test_initialization is True and solver.snapshot_after_train is True
    assert solver.solver_mode == caffe_pb2.SolverParameter.GPU


def test_all_caffe_prototxt_files_parse(caffe_dir):
    paths = sorted(caffe_dir.glob("prototxt/*.prototxt")) + sorted(caffe_dir.glob("lenet/*.prototxt"))
    assert len(paths) >= 13
    failures = {}
    for path in paths:
        try:
            if "solver" in path.name:
                read_solver(path)
            else:
                assert read_net(path).layer, "no layers"
        except (PrototxtError, AssertionError) as e:
            failures[path.name] = str(e)
    assert not failures


def test_lenet_values(caffe_dir):
    net = read_net(caffe_dir / "prototxt" / "lenet_train_test.prototxt")
    layers = {layer.name: layer for layer in net.layer}
    conv1 = layers["conv1"].convolution_param
    assert conv1.num_output == 20
    assert list(conv1.kernel_size) == [5]
    assert list(conv1.stride) == [1]
    assert conv1.weight_filler.type == "xavier"
    assert conv1.bias_filler.type == "constant"
    assert [p.lr_mult for p in layers["conv1"].param] == [1, 2]
    assert layers["pool1"].pooling_param.pool == caffe_pb2.PoolingParameter.MAX
    assert layers["mnist"].data_param.backend == caffe_pb2.DataParameter.LMDB
    assert layers["mnist"].transform_param.scale == pytest.approx(0.00390625)
    assert [r.phase for r in layers["accuracy"].include] == [caffe_pb2.TEST]

    deploy = read_net(caffe_dir / "prototxt" / "lenet.prototxt")
    assert list(deploy.layer[0].input_param.shape[0].dim) == [64, 1, 28, 28]

    solver = read_solver(caffe_dir / "prototxt" / "lenet_solver.prototxt")
    assert solver.base_lr == pytest.approx(0.01)
    assert solver.lr_policy == "inv"
    assert solver.net == "examples/mnist/lenet_train_test.prototxt"
    assert list(solver.test_iter) == [100]
    assert solver.type == "SGD"  # the default
    assert read_solver(caffe_dir / "prototxt" / "lenet_solver_adam.prototxt").type == "Adam"


def has_unknown_fields(msg):
    """Whether msg or anything inside it holds fields the schema does not know."""
    if len(unknown_fields.UnknownFieldSet(msg)):
        return True
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        children = value if field.is_repeated else [value]
        if any(has_unknown_fields(child) for child in children):
            return True
    return False


def test_caffemodel_reads(caffe_dir):
    raw = (caffe_dir / "lenet" / "lenet_iter_0.caffemodel").read_bytes()
    net = caffe_pb2.NetParameter.FromString(raw)
    assert net.name == "LeNet"
    assert [layer.name for layer in net.layer] == [
        "mnist", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "loss"]
    shapes = {layer.name: [tuple(b.shape.dim) for b in layer.blobs] for layer in net.layer if layer.blobs}
    assert shapes == {
        "conv1": [(20, 1, 5, 5), (20,)],
        "conv2": [(50, 20, 5, 5), (50,)],
        "ip1": [(500, 800), (500,)],
        "ip2": [(10, 500), (10,)],
    }
    assert len(net.layer[1].blobs[0].data) == 20 * 5 * 5
    assert not has_unknown_fields(net)
    assert net.SerializeToString() == raw  # byte for byte what Caffe wrote


def test_solverstate_reads(caffe_dir):
    raw = (caffe_dir / "lenet" / "lenet_iter_50.solverstate").read_bytes()
    state = caffe_pb2.SolverState.FromString(raw)
    assert state.iter == 50
    assert state.learned_net == "lenet_iter_50.caffemodel"
    assert state.current_step == 0
    assert len(state.history) == 8
    assert tuple(state.history[0].shape.dim) == (20, 1, 5, 5)
    assert not has_unknown_fields(state)
    assert state.SerializeToString() == raw


def test_syntax_error_names_file_line_and_field(tmp_path):
    path = tmp_path / "bad.prototxt"
    path.write_text('name: "x"\nlayer {\n  name: "a"\n  bogus_field: 3\n}\n')
    with pytest.raises(PrototxtError) as info:
        read_net(path)
    message = str(info.value)
    assert message.startswith(f"{path}:4:3: ")
    assert "bogus_field" in message


def test_error_in_string_names_default_file():
    with pytest.raises(PrototxtError, match=r"^<string>:1:\d+: .*Expected"):
        parse_net("layer { name: }")
    with pytest.raises(PrototxtError, match=r"^solver\.prototxt:2:"):
        parse_solver("base_lr: 0.1\nlr_policy: fixed\n", "solver.prototxt")  # unquoted string


def test_missing_file(tmp_path):
    path = tmp_path / "nope.prototxt"
    with pytest.raises(PrototxtError, match="nope.prototxt"):
        read_net(path)
    with pytest.raises(PrototxtError, match="nope.prototxt"):
        read_solver(path)


def test_v1_format_is_upgraded():
    """The V1 format parses and comes out in the new one (tests/test_upgrade.py: the rest)."""
    notes = []
    net = parse_net('name: "old"\nlayers { name: "conv1" type: CONVOLUTION }\n', log=notes.append)
    assert not net.layers and [(l.name, l.type) for l in net.layer] == [("conv1", "Convolution")]
    assert len(notes) == 1 and "V1" in notes[0]


def test_required_fields_are_checked():
    with pytest.raises(PrototxtError, match="clip_param.max"):
        parse_net('layer { name: "c" type: "Clip" clip_param { min: 0 } }')


def test_old_solver_type_is_upgraded():
    assert parse_solver("solver_type: NESTEROV").type == "Nesterov"
    assert not parse_solver("solver_type: ADAM").HasField("solver_type")
    with pytest.raises(PrototxtError, match="not both"):
        parse_solver('solver_type: ADAM type: "Adam"')


def test_format_round_trip(caffe_dir):
    net = read_net(caffe_dir / "prototxt" / "cifar10_full_train_test.prototxt")
    assert parse_net(format_message(net)) == net
