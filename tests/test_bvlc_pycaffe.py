"""BVLC Caffe's own pycaffe unit tests (../shared/data/caffe/pycaffe_tests, unchanged), run
with `import caffe` resolving to cgp through `cgp pycaffe`, in one subprocess; each test must
pass.

They are laid out as in Caffe's source tree (python/caffe/test/, with models/ and examples/
three folders up, which test_draw walks), by symbolic links in a temporary folder: the test
files are never copied into this repository.
"""
import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CAFFE_DIR

TESTS = CAFFE_DIR / "pycaffe_tests"
RUNNER = Path(__file__).with_name("bvlc_runner.py")
# None of them needs a GPU build of Caffe: test_nccl's new_uid asserts only where
# caffe.has_nccl(), which a CPU build, and cgp, answer False. test_draw needs Graphviz's `dot`.


def bvlc_test_ids():
    """'module.Class.method' of every test in the BVLC files, read without importing them."""
    if not TESTS.is_dir():
        return []
    ids = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "attr", getattr(b, "id", "")) == "TestCase" for b in node.bases):
                ids += [f"{path.stem}.{node.name}.{f.name}" for f in node.body
                        if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
    return ids


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """{test id: (outcome, detail)} of one run of all the BVLC tests under the alias."""
    if not TESTS.is_dir():
        pytest.skip(f"BVLC's pycaffe tests not found at {TESTS}")
    root = tmp_path_factory.mktemp("caffe")
    folder = root / "python" / "caffe" / "test"
    folder.mkdir(parents=True)
    for path in TESTS.glob("test_*.py"):
        (folder / path.name).symlink_to(path)
    # What test_draw draws: the zoo's and the examples' nets.
    (root / "models").symlink_to(CAFFE_DIR / "zoo")
    (root / "examples").symlink_to(CAFFE_DIR / "prototxt")
    out = root / "outcomes.json"
    modules = sorted(p.stem for p in TESTS.glob("test_*.py"))
    run = subprocess.run([sys.executable, "-m", "cgp", "pycaffe", str(RUNNER), str(out),
                          str(folder), *modules], cwd=folder, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text())


BVLC_TESTS = bvlc_test_ids()


@pytest.mark.parametrize("test", BVLC_TESTS)
def test_bvlc(outcomes, test):
    if test.split(".")[0] == "test_draw" and shutil.which("dot") is None:
        pytest.skip("caffe.draw.draw_net's PNG needs Graphviz's `dot` program (apt-get "
                    "install graphviz); test_draw_dot checks the graph without it")
    if test not in outcomes:   # what ran that is no test: the runner's errors
        failed = {k: v for k, v in outcomes.items() if k not in BVLC_TESTS}
        pytest.fail(f"{test} did not run; errors: {failed}")
    outcome, detail = outcomes[test]
    assert outcome == "ok", f"{test}: {outcome}\n{detail}"
