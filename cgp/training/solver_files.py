"""What a solver prototxt names, read with Caffe's rules: its train and test nets, the
paths inside it (relative to the working directory, then to the file), and the solver
fields cgp refuses or notes. Builds the nets; no workers, no engine."""
from pathlib import Path

from cgp.data.hdf5 import require_h5py
from cgp.errors import CgpError
from cgp.net import build_net
from cgp.proto import caffe_pb2
from cgp.prototxt import read_net
from cgp.solver import check_values
from cgp.training.config import DEFAULT_SEED


def resolve(name, base_dir, what):
    """A path named inside a prototxt: relative to the working directory as in Caffe,
    then relative to the folder of the file that names it (so bundled models work from
    anywhere)."""
    path = Path(name)
    if path.exists():
        return path
    if path.is_absolute():
        raise CgpError(f"{what} '{name}' not found")
    if base_dir is not None and (Path(base_dir) / name).exists():
        return Path(base_dir) / name
    where = f"{Path.cwd()}" + (f" and {base_dir}" if base_dir is not None else "")
    raise CgpError(f"{what} '{name}' not found (looked in {where})")


def check_solver_fields(sp, solver_path, log):
    """Solver fields that would change what Caffe writes or prints and that cgp does not
    implement: refused, or said once, never silently ignored. (solver_mode, device_id
    and layer_wise_reduce choose Caffe's hardware and change no result.)"""
    if sp.snapshot_diff:
        raise CgpError(f"solver {solver_path}: snapshot_diff is not supported (cgp snapshots "
                       "weights, not gradients); remove it")
    if sp.debug_info:
        log("Note: debug_info is not supported; training runs without Caffe's per-layer "
            "debug output")
    if sp.snapshot_format == caffe_pb2.SolverParameter.HDF5:   # said before the training
        require_h5py(f"solver {solver_path}: snapshot_format HDF5")


def solver_nets(sp, solver_path):
    """(train net, [test net, ...]) named by a SolverParameter, each net a pair
    (NetParameter, where it came from: its file, or the solver's field), with Caffe's rules:
    one train net source; test nets from test_net_param, test_net, then the general net once
    per remaining test_iter."""
    base = Path(solver_path).parent if solver_path else None
    solver = f"solver {solver_path}" if solver_path else "the solver"
    sources = [f for f in ("train_net_param", "train_net", "net_param", "net")
               if (sp.HasField(f) if f.endswith("param") else sp.HasField(f))]
    train_sources = [f for f in sources if f.startswith("train")]
    if len(train_sources) > 1 or ("net" in sources and "net_param" in sources):
        raise CgpError(f"solver {solver_path}: give the train net once (found {', '.join(sources)})")
    if not sources:
        raise CgpError(f"solver {solver_path}: no net: set 'net' (or train_net, net_param)")

    def load(field):
        if field.endswith("param"):
            return getattr(sp, field), f"{solver} ({field})"
        path = resolve(getattr(sp, field), base, f"net file (solver field {field})")
        return read_net(path), str(path)

    general = load("net_param") if sp.HasField("net_param") else (
        load("net") if sp.HasField("net") else None)
    train = load(train_sources[0]) if train_sources else general
    tests = [(p, f"{solver} (test_net_param {i})")
             for i, p in enumerate(sp.test_net_param)]
    for name in sp.test_net:
        path = resolve(name, base, "test_net file")
        tests.append((read_net(path), str(path)))
    if general is not None:
        tests += [general] * max(0, len(sp.test_iter) - len(tests))
    if len(tests) != len(sp.test_iter):
        raise CgpError(f"solver {solver_path}: {len(tests)} test nets but {len(sp.test_iter)} "
                       "test_iter values: give one test_iter per test net")
    if tests and sp.test_interval <= 0:
        tests = []  # Caffe never tests when test_interval is 0
    return train, tests


def build_nets(sp, solver_path, options):
    """(train net, [test net, ...]) of a solver, each built in its phase and NetState
    (train_state, test_state) with options (cgp.net.RunOptions)."""
    train_param, test_params = solver_nets(sp, solver_path)
    net = build_net(*train_param, caffe_pb2.TRAIN, options,
                    stages=sp.train_state.stage, level=sp.train_state.level)
    test_nets = []
    for i, param in enumerate(test_params):
        state = sp.test_state[i] if i < len(sp.test_state) else caffe_pb2.NetState()
        test_nets.append(build_net(*param, caffe_pb2.TEST, options,
                                   stages=state.stage, level=state.level))
    return net, test_nets


def check_solver(sp, solver_path, config, log):
    """The solver's fields checked before anything is built; returns the run's seed (the
    command line's, else the solver's random_seed, else DEFAULT_SEED)."""
    check_solver_fields(sp, solver_path, log)
    check_values(sp, solver_path, log)
    if config.max_iter is None and sp.max_iter < 0:   # Caffe would train to iteration 0
        raise CgpError(f"solver {solver_path}: max_iter must be at least 0, got {sp.max_iter}")
    if config.seed is not None:
        return config.seed
    return sp.random_seed if sp.random_seed >= 0 else DEFAULT_SEED


def weights_files(sp, solver_path):
    """The files of Caffe's solver field `weights` (the command line's --weights replaces
    it), in order."""
    base = Path(solver_path).parent if solver_path else None
    return [resolve(name, base, "weights file (solver field weights)")
            for names in sp.weights for name in names.split(",")]
