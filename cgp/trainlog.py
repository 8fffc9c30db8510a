"""`cgp train`'s training log: the trainer's lines written to a file as Caffe's glog writes
them, for Caffe's tools/extra/parse_log.py and parse_log.sh, and a CSV of every value they
carry. A sink that the command line puts in front of its output; the trainer knows nothing
of it.

The log file: every line carries glog's prefix, `I1127 10:20:30.123456 12345 cgp.py:0] `;
a `Solving <net>` line opens the training (parse_log's start time); a display line is
written as Caffe wrote it before 1.0, `Iteration 100, loss = 0.2`, followed by its speed
(`    Speed: 12.3 iter/s, 788 images/s`), so that parse_log.sh, which reads the loss as the
ninth field (plot_training_log.py runs it), reads it too.
The CSV: one row per value, `iteration,seconds,phase,name,value`: phase "train" (names
smoothed_loss, the loss the display shows, averaged over the solver's average_loss; lr;
iter_per_s and images_per_s, the display's speed; and the train net's outputs, e.g. loss)
or "test0", "test1", ... (each test net's outputs, and test_loss with test_compute_loss);
seconds since `Solving`.
"""
import csv
import re
import threading
import time
from datetime import datetime
from pathlib import Path

from cgp.errors import CgpError

# The trainer's lines that carry values (cgp.train's display and test lines).
DISPLAY = re.compile(r"^Iteration (\d+) \(([\d.e+-]+) iter/s, ([\d.e+-]+) img/s\), loss = (\S+)$")
FINAL = re.compile(r"^Iteration (\d+), loss = (\S+)$")
LR = re.compile(r"^Iteration (\d+), lr = (\S+)$")
TRAIN_OUTPUT = re.compile(r"^\s*Train net output #\d+: (\S+) = (\S+)")
TESTING = re.compile(r"^Iteration (\d+), Testing net \(#(\d+)\)$")
TEST_OUTPUT = re.compile(r"^\s*Test net output #\d+: (\S+) = (\S+)")
TEST_LOSS = re.compile(r"^Test loss: (\S+)$")


def default_path(prefix):
    """<prefix>_<YYYYmmdd-HHMMSS>.log beside the snapshots, with _2, _3, ... where that
    name is taken (two runs started in one second)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path, k = Path(f"{prefix}_{stamp}.log"), 1
    while path.exists():
        k += 1
        path = Path(f"{prefix}_{stamp}_{k}.log")
    return path


def csv_path(log_path):
    path = Path(log_path)
    if path.suffix == ".csv":
        raise CgpError(f"--log {log_path}: the log must not end in .csv, which names its CSV")
    return path.with_suffix(".csv")


class TrainLog:
    """log(line) for the trainer: echoes the line, writes it to the log file with glog's
    prefix and its values to the CSV. The files are made at the first line after start(),
    the lines before it kept until then with their times: a run that ends in an error before
    training (its options, its data, where its snapshots go) leaves no log behind, and says
    that error rather than one of the log's. close() when done."""

    def __init__(self, path, echo=print):
        self.path, self.csv_path = Path(path), csv_path(path)
        self.echo = echo
        self.started = None       # perf_counter at `Solving`
        self._pending = []        # (datetime, perf_counter, line) before the files exist
        self._file = self._csv_file = None
        self._iteration = 0       # the iteration the latest values belong to
        self._phase = "train"
        # Reentrant: a signal handler logs in the main thread, maybe while it writes a line.
        self._lock = threading.RLock()

    def __call__(self, line):
        self.echo(line)
        self.write(line)

    def start(self, net_name):
        """The `Solving <net>` line that opens the training, in the file only."""
        self.started = time.perf_counter()
        self.write(f"Solving {net_name}")

    def write(self, line):
        """The line in the file (glog's prefix on each of its lines) and its values in the
        CSV."""
        with self._lock:
            now, clock = datetime.now(), time.perf_counter()
            if self._file is None:
                self._pending.extend((now, clock, part) for part in str(line).split("\n"))
                if self.started is None or self._pending[-1][2].startswith("Solving "):
                    return
                self._open()
                pending, self._pending = self._pending, []
            else:
                pending = [(now, clock, part) for part in str(line).split("\n")]
            for entry in pending:
                self._record(*entry)
            self._file.flush()
            self._csv_file.flush()

    def _open(self):
        from cgp.snapshot import writable_folder
        writable_folder(self.path)
        try:
            self._file = open(self.path, "w", encoding="utf-8")
            self._csv_file = open(self.csv_path, "w", encoding="utf-8", newline="")
        except OSError as e:
            raise CgpError(f"cannot write the training log {e.filename}: "
                           f"{e.strerror or e}") from None
        self._csv = csv.writer(self._csv_file)
        self._csv.writerow(["iteration", "seconds", "phase", "name", "value"])

    def _line(self, now, text):
        self._file.write(f"I{now:%m%d %H:%M:%S}.{now.microsecond:06d} "
                         f"{threading.get_native_id()} cgp.py:0] {text}\n")

    def _value(self, clock, name, value):
        seconds = clock - self.started if self.started is not None else 0.0
        self._csv.writerow([self._iteration, f"{seconds:.3f}", self._phase, name, value])

    def _record(self, now, clock, text):
        m = DISPLAY.match(text)
        if m:
            it, per_s, images, loss = m.groups()
            self._iteration, self._phase = int(it), "train"
            self._line(now, f"Iteration {it}, loss = {loss}")
            self._line(now, f"    Speed: {per_s} iter/s, {images} images/s")
            for name, value in (("smoothed_loss", loss), ("iter_per_s", per_s),
                                ("images_per_s", images)):
                self._value(clock, name, value)
            return
        self._line(now, text)
        if (m := FINAL.match(text)):
            self._iteration, self._phase = int(m[1]), "train"
            self._value(clock, "smoothed_loss", m[2])
        elif (m := LR.match(text)):
            self._iteration, self._phase = int(m[1]), "train"
            self._value(clock, "lr", m[2])
        elif (m := TESTING.match(text)):
            self._iteration, self._phase = int(m[1]), f"test{m[2]}"
        elif (m := TRAIN_OUTPUT.match(text)) and self._phase == "train":
            self._value(clock, m[1], m[2])
        elif (m := TEST_OUTPUT.match(text)) and self._phase.startswith("test"):
            self._value(clock, m[1], m[2])
        elif (m := TEST_LOSS.match(text)) and self._phase.startswith("test"):
            self._value(clock, "test_loss", m[1])

    def close(self):
        for f in (self._file, self._csv_file):
            if f is not None:
                f.close()


def read_csv(path):
    """A training CSV as {(phase, name): [(iteration, seconds, value), ...]}."""
    series = {}
    try:
        with open(path, encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                series.setdefault((row["phase"], row["name"]), []).append(
                    (int(row["iteration"]), float(row["seconds"]), float(row["value"])))
    except (OSError, KeyError, ValueError) as e:
        raise CgpError(f"{path}: not a cgp training CSV ({e})") from None
    return series
