"""cgp.runtime's compiled-code cache: a kernel's cached machine code is used only while none
of cgp's compiled sources has changed, not only its own file (Numba's rule)."""
import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import cgp
import cgp.kernels
from cgp.kernels import activation, conv
from cgp.runtime import SourceStamp, compiled_sources, reduce, simd

ROOT = Path(cgp.__file__).parent
KERNELS = Path(cgp.kernels.__file__).parent


def test_every_cached_kernel_is_stamped_with_all_compiled_sources():
    """Every cached Numba function of cgp.kernels and cgp.runtime uses a locator whose stamp
    covers every compiled source: simd.py and reduce.py among them."""
    names = {p.name for p in compiled_sources()}
    assert {"simd.py", "reduce.py", "conv.py", "activation.py"} <= names
    dispatchers = [f for module in (activation, conv, reduce, simd)
                   for _, f in inspect.getmembers(module)
                   if getattr(f, "_cache", None) is not None and hasattr(f, "py_func")
                   and f.py_func.__module__ == module.__name__]
    assert len(dispatchers) > 20
    for f in dispatchers:
        assert isinstance(f._cache._impl.locator, SourceStamp), f


def test_an_edit_of_simd_recompiles_a_kernel_in_another_file(tmp_path):
    """A copy of the package: a kernel of kernels/activation.py is compiled and cached, then
    loaded from the cache; after an edit of runtime/simd.py alone it is compiled again."""
    copy = tmp_path / "site" / "cgp"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(KERNELS, copy / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    script = ("import numpy as np\n"
              "import cgp.kernels.activation as K\n"
              "x = np.ones(4, np.float32)\n"
              "K.relu_forward(x, x.copy(), np.float32(0))\n"
              "stats = K.relu_forward.stats\n"
              "print(sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))\n")
    env = {**os.environ, "PYTHONPATH": str(copy.parent)}
    env.pop("NUMBA_CACHE_DIR", None)

    def run():
        out = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        hits, misses = out.stdout.split()[-2:]
        return int(hits) > 0, int(misses) > 0
    assert run() == (False, True)    # compiled
    assert run() == (True, False)    # loaded
    with open(copy / "runtime" / "simd.py", "a") as f:
        f.write("\n# an edit\n")
    assert run() == (False, True)    # compiled again
