"""Every command the README shows runs as written, as a new user would type it.

- Fenced `sh` and `python` blocks run for real, each in a scratch folder laid out as the README
  says (the repository's root; a Caffe checkout's `examples/mnist/`). A training command runs
  until its first progress line and is then stopped with Ctrl-C, which cgp answers with a
  snapshot and exit status 0: that keeps the suite short and still shows that the command, its
  files and its options work. `pip install` and `python -m pytest` are what `.ci/run` runs.
- Inline commands (`cgp ...`, `python -m cgp ...`, `mpirun ... python -m cgp ...`) are parsed by
  cgp's own argument parser with their placeholders (MODEL, N, LOG, ...) filled in, and the
  repository files they name must exist; `python bench/X.py --option` must name an option that
  the script's --help lists.
"""
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cgp.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CAFFE_PROTOTXT = ROOT.parent / "shared" / "data" / "caffe" / "prototxt"

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# Caffe's display line after the first iteration: the solver is training.
PROGRESS = re.compile(r"^Iteration [1-9]\d* \(")

# Placeholder -> a value of the right kind, for parsing a command template.
PLACEHOLDERS = {"MODEL": "mnist", "N": "2", "R": "2", "T": "1", "M": "models/lenet_train_test.prototxt",
                "W": "w.caffemodel", "LOG": "a.log", "PNG": "a.png", "OUT": "out", "DIR": "data",
                "S": "1", "G": "2", "K": "16", "COMMAND": "train", "DB": "db", "ROOT": "images/",
                "LIST": "list.txt", "FILE": "mean.binaryproto",
                "W.caffemodel": "w.caffemodel", "S.solverstate": "s.solverstate"}


def blocks(language):
    return [body for lang, body in FENCE.findall(README) if lang == language]


def inline_commands():
    """The README's inline code spans that are commands, outside fenced blocks."""
    text = FENCE.sub("", README)
    spans = re.findall(r"`([^`\n]+)`", text.replace("\n", " "))
    starts = ("cgp ", "python -m cgp ", "mpirun ", "python bench/", "bash bench/",
              "/usr/bin/time -v python -m cgp ", "python -m pytest ")
    return sorted({s.replace("\\|", "|") for s in spans if s.startswith(starts)})


def shell_lines(block):
    """The commands of a sh block: comments dropped, `a && b` split."""
    for line in block.splitlines():
        line = line.split("  #")[0].strip()
        if line and not line.startswith("#"):
            yield from (part.strip() for part in line.split("&&"))


def env_with_this_python():
    """`python` on PATH is the interpreter running the tests (mpirun runs `python` too)."""
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                PYTHONUNBUFFERED="1")


def run_to_end(command, cwd, timeout=600):
    done = subprocess.run(command, shell=True, cwd=cwd, env=env_with_this_python(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def run_until_progress(command, cwd, timeout=600):
    """Runs a training command until its first progress line, then Ctrl-C (SIGINT to its
    process group: mpirun and its ranks too); returns (exit status, output)."""
    # exec: the signal goes to the command itself, not to a shell waiting for it.
    proc = subprocess.Popen(f"exec {command}", shell=True, cwd=cwd, env=env_with_this_python(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines, deadline = [], time.monotonic() + timeout
    try:
        for line in proc.stdout:
            lines.append(line)
            if PROGRESS.match(line):
                os.killpg(proc.pid, signal.SIGINT)
                break
            assert time.monotonic() < deadline, f"{command}: no progress line in {timeout} s"
        lines.extend(proc.stdout)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = "".join(lines)
    assert any(PROGRESS.match(line) for line in lines), f"{command}\n{output[-3000:]}"
    return code, output


def run_block_line(line, cwd):
    """One line of a sh block: a training command until its progress, else to its end."""
    if " train " in f"{line} ":
        code, output = run_until_progress(line, cwd)
        if not line.startswith("mpirun"):   # mpirun reports its ranks' Ctrl-C its own way
            assert code == 0 and "Snapshotting" in output, f"{line}: {code}\n{output[-3000:]}"
        return output
    return run_to_end(line, cwd)


# -- fenced blocks -----------------------------------------------------------------------
def test_the_readme_has_the_blocks_this_test_runs():
    """Each sh block is run by one test below; a new block needs its own set-up here."""
    sh = blocks("sh")
    assert len(sh) == 3 and len(blocks("python")) == 1
    assert "pip install -e ." in sh[0] and "examples/mnist" in sh[1] and "mpirun" in sh[2]


def test_quick_start(tmp_path):
    lines = list(shell_lines(blocks("sh")[0]))
    ci = (ROOT / ".ci" / "run").read_text()
    for line in lines:
        if line.startswith("pip install"):
            # The set-up the suite runs after: .ci/run installs the package with its tests'
            # extras.
            assert 'pip install -q -e ".[test]"' in ci, line
        elif line == "python -m pytest":
            assert "python -m pytest" in ci   # this suite itself
        else:
            # Snapshots go to the working directory's snapshots/: a scratch folder here.
            run_block_line(line, tmp_path)
    assert list((tmp_path / "snapshots").glob("lenet_iter_*.caffemodel"))


@pytest.mark.skipif(not CAFFE_PROTOTXT.is_dir(), reason="Caffe's example prototxts not found")
def test_caffe_session_with_caffes_own_files(tmp_path):
    """From the root of a Caffe checkout: its examples/mnist prototxts, unchanged."""
    examples = tmp_path / "examples" / "mnist"
    examples.mkdir(parents=True)
    for name in ("lenet_solver.prototxt", "lenet_train_test.prototxt"):
        shutil.copy(CAFFE_PROTOTXT / name, examples / name)
    for line in shell_lines(blocks("sh")[1]):
        if line.startswith("python -m cgp test"):
            # The README tests the finished run's weights; the interrupted run's snapshot
            # stands in for them (the same net, fewer iterations).
            wanted = re.search(r"--weights (\S+)", line).group(1)
            snapshot = max((tmp_path / "examples" / "mnist").glob("lenet_iter_*.caffemodel"),
                           key=lambda p: p.stat().st_mtime)
            shutil.copy(snapshot, tmp_path / wanted)
            output = run_to_end(line, tmp_path)
            accuracy = float(re.findall(r"^accuracy = ([\d.]+)", output, re.M)[-1])
            assert accuracy > 0.5, output
        else:
            run_block_line(line, tmp_path)


def test_several_ranks(tmp_path):
    pytest.importorskip("mpi4py")
    (line,) = shell_lines(blocks("sh")[2])
    output = run_block_line(line, tmp_path)
    assert "on 2 ranks" in output, output[-2000:]


def test_python_example(tmp_path):
    """Run from a folder laid out as the repository's root (its models/)."""
    (tmp_path / "models").symlink_to(ROOT / "models")
    (tmp_path / "example.py").write_text(blocks("python")[0])
    output = run_to_end(f"{shlex.quote(sys.executable)} example.py", tmp_path)
    assert (tmp_path / "snapshots" / "lenet_iter_100.caffemodel").is_file()
    accuracy = float(output.split()[-1])
    assert 0.5 < accuracy <= 1.0, output


# -- inline commands ---------------------------------------------------------------------
def template_argv(command):
    """A README command template as cgp's argv: prefixes dropped, [optional] parts kept,
    a|b alternatives taken at their first, placeholders filled in."""
    command = re.sub(r"^(/usr/bin/time -v )?(mpirun( -\S+)* -np \S+ )?python -m cgp ", "cgp ",
                     command)
    assert command.startswith("cgp "), command
    words = []
    for word in shlex.split(command.replace("[", " ").replace("]", " "))[1:]:
        if word == "...":
            continue
        word = word.split("|")[0]
        words.append(PLACEHOLDERS.get(word, word))
    return words


def parses(argv):
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:   # --help exits 0; a parse error exits 2
        return e.code == 0
    return True


@pytest.mark.parametrize("command", [c for c in inline_commands()
                                     if re.match(r"(/usr/bin/time -v |mpirun .*)?(python -m )?cgp ",
                                                 c)])
def test_inline_cgp_command_parses(command, capsys):
    argv = template_argv(command)
    assert parses(argv), f"README: `{command}` is refused by cgp's parser: {argv}"
    for word in argv:
        if word.startswith("models/") or (word.startswith("../shared/")
                                          and (ROOT.parent / "shared").is_dir()):
            assert (ROOT / word).exists(), f"README: `{command}`: no file {word}"


def bench_help(script, cache={}):
    if script not in cache:
        done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, f"bench/{script} --help: {done.stderr[-2000:]}"
        cache[script] = done.stdout
    return cache[script]


@pytest.mark.parametrize("command", [c for c in inline_commands()
                                     if c.startswith(("python bench/", "bash bench/",
                                                      "python -m pytest "))])
def test_inline_bench_command_exists(command):
    words = shlex.split(command)
    path = ROOT / next(w for w in words if w.startswith(("bench/", "tests/")))
    assert path.is_file(), command
    if words[0] == "python" and words[1].startswith("bench/"):
        text = bench_help(path.name)
        for option in (w for w in words if w.startswith("--")):
            assert option in text, f"README: `{command}`: bench/{path.name} has no {option}"


def test_the_readme_stays_a_short_front_door():
    assert len(README.splitlines()) <= 250, "README.md: at most 250 lines; detail goes to DESIGN.md"


def test_the_inline_checks_see_the_commands():
    """The checks above find the README's commands (a change of format would hide them)."""
    commands = inline_commands()
    assert any(c.startswith("cgp plot") for c in commands)
    assert any(c.startswith("python bench/") for c in commands)
    assert not parses(["plot", "a.log"])   # the parser does refuse a plot without --out


def test_the_design_map_matches_the_tree():
    """DESIGN.md's section 0 names every package and top-level module of cgp/ (and names
    nothing that is not there)."""
    design = (ROOT / "DESIGN.md").read_text()
    table = design[design.index("## 0. The map"):design.index("## 1. ")]
    named = set(re.findall(r"`(cgp/[\w/.]+?)/?`", table))
    tree = {f"cgp/{p.name}" for p in (ROOT / "cgp").iterdir()
            if (p.is_dir() and (p / "__init__.py").exists())
            or (p.suffix == ".py" and not p.name.startswith("__"))}
    assert tree - named == set(), f"DESIGN.md's map misses {sorted(tree - named)}"
    assert named - tree == set(), f"DESIGN.md's map names {sorted(named - tree)}, not in cgp/"
