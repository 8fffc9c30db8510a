"""A run's settings from the command line (or pycaffe's arguments): an immutable object,
checked as it is made; the prototxt owns everything else."""
from dataclasses import dataclass, field

from cgp.device import check_device
from cgp.errors import CgpError
from cgp.runtime.procs import default_workers
from cgp.training.signals import check_effects

DEFAULT_SEED = 1701  # used when neither --seed nor the solver's random_seed is set
SHARING = ("sync", "async", "hybrid")   # --sharing
WORKERS = ("threads", "processes")


@dataclass(frozen=True)
class RunConfig:
    """Run settings from the command line; the prototxt owns everything else."""
    threads: int = 1
    chunks: int = 16
    seed: int = None          # overrides the solver's random_seed
    data_dir: str = None
    download: bool = True
    max_iter: int = None      # overrides the solver's max_iter
    progress: bool = True     # a progress bar when stderr is a terminal
    snapshot_prefix: str = None
    sigint_effect: str = "stop"       # Caffe's --sigint_effect: stop, snapshot or none
    sighup_effect: str = "snapshot"   # Caffe's --sighup_effect
    sigterm_effect: str = "stop"      # a batch scheduler's notice before it kills the job
    affinity: bool = False    # pin workers to cores
    # Run the workers as "threads" or as forked "processes" (default: procs.default_workers).
    workers: str = field(default_factory=default_workers)
    denormals: str = "flush"  # subnormal floats: "flush" to zero (fast) or "keep" (IEEE)
    staleness: int = 0        # the update of iteration t applies iteration t - S's gradient
    # How ranks share the weights: "sync" (every rank computes its share of every batch),
    # "async" or "hybrid" in `groups` groups (cgp.comm.sharing: not reproducible).
    sharing: str = "sync"
    groups: int = 0
    # Where the chunks compute: "cpu", "gpu" (CuPy) or "numpy" (the GPU path on the host).
    device: str = "cpu"
    device_id: int = None     # the GPU's CUDA index (default: the local rank's)
    # Also snapshot once this many seconds have passed since the last one (rank 0's clock,
    # agreed as a signal's request is), and rank 0's progress file (cgp.comm.elastic): what
    # `cgp launch` supervises.
    snapshot_seconds: float = None
    heartbeat: str = None

    def __post_init__(self):
        # Refused before anything runs: a seed out of range would otherwise fail only when
        # the first snapshot records it, after the training.
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise CgpError(f"--seed must be from 0 to 2**63 - 1 (Caffe's random_seed is a "
                           f"64-bit signed integer), got {self.seed}")
        if self.max_iter is not None and self.max_iter < 0:
            raise CgpError(f"--iters must be at least 0, got {self.max_iter}")
        if self.sharing not in SHARING:
            raise CgpError(f"--sharing {self.sharing}: expected one of {', '.join(SHARING)}")
        if self.groups and self.sharing != "hybrid":
            raise CgpError(f"--groups {self.groups} is for --sharing hybrid (this run has "
                           f"--sharing {self.sharing})")
        if self.sharing == "hybrid" and not self.groups:
            raise CgpError("--sharing hybrid needs --groups G: the ranks are cut into G groups, "
                           "synchronous within, asynchronous between them")
        check_device(self.device, self.threads)
        if self.snapshot_seconds is not None and not self.snapshot_seconds > 0:
            raise CgpError(f"--snapshot-seconds must be more than 0, got {self.snapshot_seconds}")
        if self.workers not in WORKERS:
            raise CgpError(f"--workers {self.workers}: expected one of {', '.join(WORKERS)}")
        check_effects(self.sigint_effect, self.sighup_effect, self.sigterm_effect)
        if self.staleness and self.sharing != "sync":
            raise CgpError(f"--staleness {self.staleness} delays the updates of synchronous "
                           f"training by a fixed count; --sharing {self.sharing} has delays of "
                           "its own, set by timing: give one or the other")


def worker_kind(config, backend, nets, log):
    """How this run's workers run: config.workers, but threads on a device (one worker
    drives it) and where a Python layer must run in the process that built the net (it
    holds the user's objects). The same bits either way."""
    if backend is not None:
        return "threads"
    python = [e.layer.name for net in nets for e in net.entries if e.layer.type_name == "Python"]
    if config.workers == "processes" and python:
        log(f"Note: Python layer '{python[0]}' runs in the process that built the net: the "
            "workers run as threads")
        return "threads"
    return config.workers
