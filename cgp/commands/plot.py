"""`cgp plot`: training curves from training logs (cgp's, or Caffe's own glog logs) into a
PNG: loss, test accuracy and throughput against iterations and against wall time, several
runs overlaid (e.g. 1 against 16 threads). Needs matplotlib (the `plot` extra).
"""
import re
from datetime import datetime
from pathlib import Path

from cgp.errors import CgpError, require

ITERATION = re.compile(r"Iteration (\d+)")
LOSS = re.compile(r"Iteration \d+.*, loss = (\S+)")
TESTING = re.compile(r"Iteration \d+, Testing net \(#(\d+)\)")
TEST_OUTPUT = re.compile(r"Test net output #\d+: (\S+) = (\S+)")
SPEED = re.compile(r"Speed: (\S+) iter/s, (\S+) images/s")          # cgp's log files
CAFFE_SPEED = re.compile(r"Iteration \d+ \((\S+) iter/s")            # Caffe 1.0's display
STAMP = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+) ")


def add_plot(sub):
    p = sub.add_parser("plot", help="draw training curves from training logs into a PNG",
                       description="Loss, test accuracy and throughput against iterations and "
                                   "against wall time, one line per log, from `cgp train` "
                                   "logs (or Caffe's glog logs). Needs matplotlib.")
    p.add_argument("logs", nargs="+", metavar="LOG", help="training log file(s)")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--labels", default=None,
                   help="comma-separated legend labels, one per log (default: the file names)")
    p.set_defaults(run=cmd_plot)


def _float(text):
    try:
        return float(text)
    except ValueError:
        return None


def read_log(path):
    """{"loss", "accuracy", "throughput": [(iteration, seconds since Solving, value)], "unit":
    "images/s" or "iter/s"} of one glog-format training log. accuracy: test net #0's first
    output whose name holds "accuracy"."""
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as e:
        raise CgpError(f"cannot read training log {path}: {e.strerror or e}") from None
    series = {"loss": [], "accuracy": [], "throughput": [], "unit": "iter/s"}
    year = datetime.now().year
    start = None
    iteration, test_net, accuracy_name = None, None, None
    for line in lines:
        stamp = STAMP.match(line)
        if stamp is None:
            continue
        month, day, hour, minute, second, fraction = stamp.groups()
        when = datetime(year, int(month), int(day), int(hour), int(minute), int(second),
                        int(fraction[:6].ljust(6, "0")))
        if start is None:
            if "] Solving " in line:
                start = when
            continue
        seconds = (when - start).total_seconds()
        if seconds < 0:     # the log went past a new year
            seconds += (datetime(year + 1, 1, 1) - datetime(year, 1, 1)).total_seconds()
        if (m := ITERATION.search(line)):
            iteration = int(m[1])
        if (m := TESTING.search(line)):
            test_net = int(m[1])
            continue
        if (m := LOSS.search(line)) and (value := _float(m[1])) is not None:
            series["loss"].append((iteration, seconds, value))
            test_net = None
        if (m := TEST_OUTPUT.search(line)) and test_net == 0:
            name, value = m[1], _float(m[2])
            if accuracy_name is None and "accuracy" in name:
                accuracy_name = name
            if name == accuracy_name and value is not None:
                series["accuracy"].append((iteration, seconds, value))
        if (m := SPEED.search(line)) and (value := _float(m[2])) is not None:
            series["throughput"].append((iteration, seconds, value))
            series["unit"] = "images/s"
        elif (m := CAFFE_SPEED.search(line)) and (value := _float(m[1])) is not None:
            series["throughput"].append((iteration, seconds, value))
    if start is None:
        raise CgpError(f"training log {path}: no 'Solving' line in glog's format (write one "
                       "with `cgp train --log FILE`)")
    if not series["loss"]:
        raise CgpError(f"training log {path}: no training iteration logged")
    return series


def plot(paths, out, labels=None):
    """Writes the PNG `out` of the logs `paths`; returns its path."""
    Figure = require("matplotlib.figure", "plot", "cgp plot").Figure
    from cgp.snapshot import writable_folder

    labels = labels or [Path(p).stem for p in paths]
    if len(labels) != len(paths):
        raise CgpError(f"--labels gives {len(labels)} labels for {len(paths)} logs")
    runs = [read_log(p) for p in paths]
    out = writable_folder(out)
    fig = Figure(figsize=(15, 8.5), layout="constrained")
    axes = fig.subplots(2, 3)
    units = {run["unit"] for run in runs}
    panels = (("loss", "training loss"), ("accuracy", "test accuracy"),
              ("throughput", f"throughput ({' or '.join(sorted(units))})"))
    for row, (axis, xlabel) in enumerate(((0, "iteration"), (1, "wall time (s)"))):
        for col, (key, title) in enumerate(panels):
            ax = axes[row][col]
            for run, label in zip(runs, labels):
                points = run[key]
                if points:
                    ax.plot([p[axis] for p in points], [p[2] for p in points],
                            marker="." if len(points) < 30 else None, label=label)
            ax.set_xlabel(xlabel)
            ax.set_title(title)
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend(fontsize="small")
            else:
                ax.text(0.5, 0.5, "not in the logs", ha="center", va="center",
                        transform=ax.transAxes, color="gray")
    fig.savefig(out, dpi=100)
    return out


def cmd_plot(args, log=print):
    labels = args.labels.split(",") if args.labels else None
    out = plot(args.logs, args.out, labels)
    log(f"cgp plot: {len(args.logs)} run(s) drawn into {out}")
    return 0
