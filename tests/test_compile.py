"""The sharing out of a first run's compile (cgp.runtime.compile): a process that defers
kernels skips them unclaimed and compiles them afterwards, largest first. The hooks patch
Numba's dispatcher for the whole process, so each case runs in a subprocess of its own;
the two-process `cgp train` itself is tests/test_cli.py's
test_first_run_compiles_in_processes_to_the_same_bits."""
import json
import os
import subprocess
import sys
import textwrap

KERNELS = '''
import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def fill(x, v):
    for i in range(x.size):
        x[i] = v


@njit(cache=True, nogil=True)
def total(x):
    return x.sum()


@njit(cache=True, nogil=True)
def broken(x):
    x.no_such_attribute = 1.0


@njit(cache=True, nogil=True)
def taken(x):
    x[0] = 2.0


@njit(cache=True, nogil=True)
def helper(x):
    return x[0] + x[-1]


@njit(cache=True, nogil=True)
def large(x):
    x[0] = helper(x)


@njit(cache=True, nogil=True)
def doubled(x):
    x[-1] = 2.0 * helper(x)
'''

SCRIPT = '''
import json, sys
from pathlib import Path
import numpy as np
from cgp.runtime.compile import Share
import kmod

claims = Path(sys.argv[1])
for name in ("kmod.taken", "kmod.taken.ready"):
    (claims / name).touch()   # claimed and compiled by another process
share = Share(claims, prefix="kmod")
share.install()
share.deferring = True
x = np.zeros(4)
kmod.fill(x, 1.0)
kmod.broken(x)
kmod.taken(x)
kmod.large(x)
seen = {"total": float(kmod.total(x)), "after_skips": x.tolist(),
        "noted": sorted(name for name, _ in share.deferred)}
share.deferring = False
order = []
compiled = share.compiled
share.compiled = lambda name, d, c: order.append(name) or compiled(name, d, c)
share.compile_deferred()
kmod.fill(x, 3.0)
seen.update(order=order, x=x.tolist(),
            signatures={k: len(getattr(kmod, k).signatures)
                        for k in ("fill", "broken", "taken", "large", "total")},
            files=sorted(p.name for p in claims.iterdir()))
print(json.dumps(seen))
'''


def test_deferred_kernels_skip_unclaimed_then_compile_largest_first(tmp_path):
    """While deferring, kernels that return nothing are skipped (their outputs untouched)
    and claimed by no one, one returning a value compiles; compile_deferred then claims and
    compiles the noted ones no other process holds, the largest (with its callees) first,
    marks each ready (a failed one too, so that no process waits on it) and done, and a
    failure to compile one stops none of the rest."""
    (tmp_path / "kmod.py").write_text(KERNELS)
    claims = tmp_path / "claims"
    claims.mkdir()
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(claims)],
                         capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path),
                              "NUMBA_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stdout + out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["after_skips"] == [0.0] * 4 and seen["total"] == 0.0
    assert seen["noted"] == ["kmod.broken", "kmod.fill", "kmod.large", "kmod.taken"]
    assert seen["order"] == ["kmod.large", "kmod.fill", "kmod.broken"]   # not taken
    assert seen["x"] == [3.0] * 4   # fill compiled: the call now runs it
    assert seen["signatures"] == {"fill": 1, "broken": 0, "taken": 0, "large": 1, "total": 1}
    assert set(seen["files"]) == {
        "kmod.taken", "kmod.taken.ready", "kmod.total", "kmod.total.ready", "kmod.total.done",
        "kmod.fill", "kmod.fill.ready", "kmod.fill.done", "kmod.large", "kmod.large.ready",
            "kmod.large.done", "kmod.broken", "kmod.broken.ready",
        "kmod.broken.done"}   # done counts a compile tried, as the claims' do


LEAVES = '''
import json, sys, threading, time
from pathlib import Path
import numpy as np
from cgp.runtime import compile as cc
import kmod

cc.SHARED_SOURCE = 1               # any callee in common: kmod's are small
claims = Path(sys.argv[1])
(claims / "kmod.large").touch()    # another process compiles a kernel of kmod now
share = cc.Share(claims, prefix="kmod")
share.install()
order = []
compiled = share.compiled
share.compiled = lambda name, d, c: order.append(name) or compiled(name, d, c)
x = np.zeros(4)
kmod.fill(x, 1.0)                  # shares no callee with large: compiled here, now
kmod.doubled(x)                    # shares helper: left to the other process
share.compile_deferred()           # large is still compiling: kept
seen = {"kept": sorted(name for name, _ in share.deferred), "claimed": sorted(share.mine),
        "x": x.tolist()}
kmod.taken(x)                      # kmod is left: noted too
threading.Timer(0.3, (claims / "kmod.large.ready").touch).start()
started = time.perf_counter()
seen.update(left=sorted(share.left), noted=sorted(name for name, _ in share.deferred))
share.compile_deferred(wait=True)
seen.update(waited=time.perf_counter() - started >= 0.3, order=order)
kmod.fill(x, 5.0)
kmod.doubled(x)
seen.update(after=x.tolist(), compiled=sorted(share.mine))
print(json.dumps(seen))
'''


def test_a_file_another_compiles_from_is_left_to_it(tmp_path):
    """A kernel returning nothing, of a file that another process is compiling a kernel of
    that shares callees with it, is skipped and noted, not claimed, and so are the file's
    other kernels afterwards; one that shares none is compiled at once; compile_deferred
    keeps the noted ones while that kernel compiles, or with `wait`, compiles first those
    sharing nothing with it, then the others once it is done."""
    (tmp_path / "kmod.py").write_text(KERNELS)
    claims = tmp_path / "claims"
    claims.mkdir()
    out = subprocess.run([sys.executable, "-c", LEAVES, str(claims)],
                         capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path),
                              "NUMBA_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stdout + out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen == {"kept": ["kmod.doubled"], "claimed": ["kmod.fill"], "x": [1.0] * 4,
                    "left": ["kmod"], "noted": ["kmod.doubled", "kmod.taken"],
                    "waited": True, "order": ["kmod.fill", "kmod.taken", "kmod.doubled"],
                    "after": [5.0, 5.0, 5.0, 20.0],
                    "compiled": ["kmod.doubled", "kmod.fill", "kmod.taken"]}


def test_source_size_counts_callees_once(tmp_path):
    """A kernel's size is its source's and its jitted callees', each once, however often
    they are called; what two kernels share, the functions that both compile (callees, or
    one of them called by the other), or all of the first's where the second is unknown."""
    (tmp_path / "kmod.py").write_text(KERNELS + '''

@njit(cache=True, nogil=True)
def twice(x):
    x[0] = helper(x) + helper(x)
''')
    code = ("import inspect, kmod\nfrom cgp.runtime.compile import shared_source, source_size\n"
            "s = lambda f: len(inspect.getsource(f.py_func))\n"
            "print(source_size(kmod.twice.py_func) == s(kmod.twice) + s(kmod.helper),"
            " source_size(kmod.fill.py_func) == s(kmod.fill),"
            " shared_source(kmod.twice.py_func, kmod.large.py_func) == s(kmod.helper),"
            " shared_source(kmod.large.py_func, kmod.helper.py_func) == s(kmod.helper),"
            " shared_source(kmod.fill.py_func, kmod.large.py_func) == 0,"
            " shared_source(kmod.fill.py_func, None) == s(kmod.fill))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path),
                              "NUMBA_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"] * 6


IN_PYTHON = '''
import threading, time, json, sys
from pathlib import Path
from numba import njit
from numba.extending import overload
from cgp.runtime.compile import Share


def stub():
    raise NotImplementedError("Numba's alone")


@overload(stub)
def _stub():
    return lambda: 7


@njit(cache=True, nogil=True)
def half(n):
    return n // 2


@njit(cache=True, nogil=True)
def sizes(n, out):
    out[0] = half(n)
    return (half(n) + 1, n * 3)


@njit(cache=True, nogil=True)
def numba_only(n):
    return n + stub()


@njit(cache=True, nogil=True)
def numba_also(n):
    return n - stub()


@njit(cache=True, nogil=True)
def first(x):
    return x[0]


import numpy as np
claims = Path(sys.argv[1])
(claims / "__main__.numba_only").touch()   # another's, not ready
share = Share(claims, prefix="__main__")
share.install()
share.interpreting = True
out = np.zeros(1, np.int64)
got = sizes(np.int64(9), out)
started = time.perf_counter()
threading.Timer(0.5, (claims / "__main__.numba_only.ready").touch).start()
awaited = numba_only(1)
waited = time.perf_counter() - started >= 0.5
print(json.dumps({"sizes": [int(v) for v in got], "out": int(out[0]), "awaited": awaited,
                  "waited": waited, "also": numba_also(10), "large": first(np.ones(1 << 17)),
                  "compiled": [len(f.signatures)
                               for f in (sizes, half, numba_only, numba_also, first)],
                  "claimed": sorted(share.mine)}))
'''


def test_set_up_runs_another_process_s_kernel_as_python(tmp_path):
    """While interpreting (the first compiling process's Trainer set-up), a kernel that
    returns a value, unclaimed or another's not yet compiled, runs as Python, the kernels it
    calls too, and nothing compiles or is claimed; one that Python cannot run, or whose
    arrays are large, is claimed and compiled where no one has, else awaited and then
    compiled (unsaved, as any awaited kernel of another's)."""
    claims = tmp_path / "claims"
    claims.mkdir()
    (tmp_path / "in_python.py").write_text(IN_PYTHON)   # a file: Numba caches its kernels
    out = subprocess.run([sys.executable, str(tmp_path / "in_python.py"), str(claims)],
                         capture_output=True, text=True,
                         env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stdout + out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen == {"sizes": [5, 27], "out": 4, "awaited": 8, "waited": True, "also": 3,
                    "large": 1.0, "compiled": [0, 0, 1, 1, 1],
                    "claimed": ["__main__.first", "__main__.numba_also"]}
