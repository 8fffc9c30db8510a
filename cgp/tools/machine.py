"""What a timing depends on besides cgp: the machine's description (CPU, cores, memory, SIMD,
library versions, cgp's commit, the command), the CPU time that others took while we measured
(other processes, the hypervisor's steal time), and NumPy's matmul rate as a yardstick. For
`cgp bench speedup`'s reports; nothing here times cgp itself.
"""
import os
import sys
import time
from pathlib import Path

# platform, shlex, subprocess, psutil and NumPy are imported where used: the command line
# imports cgp.tools.speedup, and through it this module, on every run.

SIMD_FLAGS = ("sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq",
              "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
              "asimd", "sve", "sve2")


def cpuinfo():
    """(model name, set of flags) from /proc/cpuinfo; (platform's guess, empty) elsewhere."""
    import platform
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "hardware", "cpu model") and model is None:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def source_revision():
    """The git commit of the cgp source that runs, "+changes" added when its tracked files
    differ from it; None outside a git checkout (an installed copy)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]   # the checkout: cgp/tools/machine.py
    if not (root / ".git").exists():
        return None

    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=30)
    try:
        head, status = git("rev-parse", "HEAD"), git("status", "--porcelain",
                                                     "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):   # no git
        return None
    if head.returncode or status.returncode:
        return None
    return head.stdout.strip() + ("+changes" if status.stdout.strip() else "")


def machine_info(extra_versions=()):
    """What the numbers depend on: CPU, cores, memory, SIMD, library versions (cgp's own
    with its commit), BLAS, the command."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import numba
    import numpy
    import psutil
    import scipy
    from threadpoolctl import threadpool_info

    model, flags = cpuinfo()
    try:
        cgp_version = version("cgp")
    except PackageNotFoundError:
        cgp_version = None
    versions = {"cgp": cgp_version, "cgp_commit": source_revision(),
                "python": platform.python_version(), "numpy": numpy.__version__,
                "numba": numba.__version__, "scipy": scipy.__version__}
    versions.update(extra_versions)
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "cpu": model,
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "usable_cores": affinity,
        "memory_bytes": psutil.virtual_memory().total,
        "simd": [f for f in SIMD_FLAGS if f in flags],
        "platform": platform.platform(),
        "versions": versions,
        "blas": threadpool_info(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "command": command_line(),
    }


class ForeignLoad:
    """How many cores other processes kept busy while we measured: the machine's busy CPU
    time less this process's and its children's (worker processes, --ceiling copies), over
    the wall time. Near 0 on a quiet machine; on a shared
    one, thread counts above the idle cores time the neighbours, not cgp. In a virtual
    machine, also `steal`: how many of its CPUs' worth of time the hypervisor gave to other
    guests while ours wanted to run (Linux reports it), which no process inside can see."""

    def __enter__(self):
        import psutil
        self._process = psutil.Process()
        self._start = self._sample()
        self.cores = self.steal = None
        return self

    def _sample(self):
        import psutil
        t = psutil.cpu_times()
        steal = getattr(t, "steal", 0.0)
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0) - steal
        return time.perf_counter(), busy, self._ours(), steal

    def _ours(self):
        """CPU seconds of this process and its children, live or ended and waited for."""
        import psutil
        t = self._process.cpu_times()
        seconds = t.user + t.system + t.children_user + t.children_system
        for child in self._process.children(recursive=True):
            try:
                c = child.cpu_times()
            except psutil.Error:   # it ended since the listing
                continue
            seconds += c.user + c.system
        return seconds

    def __exit__(self, *exc):
        wall, busy, mine, steal = (b - a for a, b in zip(self._start, self._sample()))
        self.cores = max(0.0, (busy - mine) / wall) if wall > 0 else 0.0
        self.steal = max(0.0, steal / wall) if wall > 0 else 0.0


def command_line():
    import shlex
    argv = list(sys.argv)
    if argv and Path(argv[0]).name == "__main__.py" and Path(argv[0]).parent.name == "cgp":
        argv[0:1] = ["python", "-m", "cgp"]
    return shlex.join(argv)

MATMUL_SIZE = 1024


def matmul_gflops(size=MATMUL_SIZE, products=3):
    """NumPy's single-threaded float32 matrix product rate on this machine, in GFLOP/s
    (2 n^3 FLOPs per n x n product), over `products` products after one untimed."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    a = np.random.default_rng(0).random((size, size), dtype=np.float32)
    out = np.empty_like(a)
    with threadpool_limits(limits=1):
        np.matmul(a, a, out=out)
        started = time.perf_counter()
        for _ in range(products):
            np.matmul(a, a, out=out)
        return products * 2 * size ** 3 / (time.perf_counter() - started) / 1e9


def steal_seconds():
    """CPU seconds the hypervisor has withheld from this (virtual) machine since boot, summed
    over its CPUs (Linux's steal time; 0 where the OS does not report it)."""
    import psutil
    return getattr(psutil.cpu_times(), "steal", 0.0)
