"""Elastic training (`cgp launch`): a supervisor that runs `cgp train` as mpirun ranks, and
when a rank dies or hangs ends the job and starts it again on fewer ranks from its last
snapshot; when ranks come back it grows again at the next snapshot. Since the weights do not
depend on the rank count, the run ends bit for bit as an uninterrupted one.

It watches rank 0's heartbeat (Heartbeat, a file the trainer rewrites as it progresses) and
mpirun's exit. It does not train, and holds no MPI state: every change of size is a new
mpirun. Without mpirun's hostfile the ranks run on this machine.
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from cgp.errors import CgpError

# The heartbeat is rewritten at most this often (and after every snapshot): a rewrite is a
# file's creation and rename, cheap beside a step but not beside a step of a tiny net.
BEAT_SECONDS = 0.2

# A rank hangs when the heartbeat stands still for HANG_FACTOR times the longest pause
# between two of its rewrites seen so far (a step, a test batch, a snapshot), at least the
# floor (--hang-floor).
HANG_FACTOR = 3

# How often the supervisor looks at the heartbeat and at mpirun, and lists the job's
# processes.
POLL_SECONDS = 0.05
LIST_SECONDS = 1.0

# How long the ranks have to stop with a snapshot once the supervisor is told to stop.
STOP_SECONDS = 60

# Relaunches in a row that end before any new snapshot before the supervisor gives up: a
# fault that every launch meets (a broken node left in the host file, a full disk).
MAX_FRUITLESS = 3


# -- rank 0's side: the heartbeat ----------------------------------------------------------
@dataclass
class Beat:
    """What the heartbeat file holds: `count` grows with every rewrite (a test batch too);
    `snapshot`, the iteration of the latest snapshot this job wrote (-1: none yet);
    `step_seconds`, the mean time of the steps since the rewrite before; `snapshot_seconds`,
    the time the latest snapshot took to write."""
    count: int = 0
    iteration: int = 0
    snapshot: int = -1
    step_seconds: float = 0.0
    snapshot_seconds: float = 0.0
    finished: bool = False      # trained to the end: what is left is the processes' exit


class Heartbeat:
    """Rank 0's progress file, replaced whole (a temporary sibling renamed over it) so that
    a reader never sees a part of it."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.state = Beat()
        self.written = None      # (time, iteration) of the last rewrite

    def beat(self, iteration, force=False):
        """Training has reached `iteration` (or runs a test batch there)."""
        now = time.monotonic()
        if self.written is not None and not force and now - self.written[0] < BEAT_SECONDS:
            return
        if self.written is not None and iteration > self.written[1]:
            self.state.step_seconds = (now - self.written[0]) / (iteration - self.written[1])
        self.state.count += 1
        self.state.iteration = iteration
        self.temp.write_text(json.dumps(self.state.__dict__))
        os.replace(self.temp, self.path)
        self.written = (now, iteration)

    def finish(self, iteration):
        """Training is over (done or stopped): the ranks now close and exit."""
        self.state.finished = True
        self.beat(iteration, force=True)

    def snapshot(self, iteration, seconds):
        """A snapshot of `iteration` is committed; it took `seconds` to write."""
        self.state.snapshot, self.state.snapshot_seconds = iteration, seconds
        self.beat(iteration, force=True)


def read_beat(path):
    """The heartbeat file's Beat; None before the first rewrite."""
    try:
        return Beat(**json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return None


# -- hosts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def read_hostfile(path):
    """The hosts of an Open MPI host file: lines 'name [slots=N] [max_slots=M]', # comments;
    a host without slots= has one. CgpError naming the line otherwise."""
    hosts = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise CgpError(f"host file {path}: {e.strerror or e}") from None
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = 1
        for word in words[1:]:
            match = re.fullmatch(r"(slots|max_slots|max-slots)=(\d+)", word)
            if match is None:
                raise CgpError(f"host file {path}, line {number}: '{word}' is not slots=N "
                               "or max_slots=N (Open MPI's host file format)")
            if match[1] == "slots":
                slots = int(match[2])
        if slots < 1:
            raise CgpError(f"host file {path}, line {number}: slots must be at least 1")
        hosts.append(Host(words[0], slots))
    if not hosts:
        raise CgpError(f"host file {path}: no hosts")
    return hosts


def write_hostfile(path, hosts):
    Path(path).write_text("".join(f"{h.name} slots={h.slots}\n" for h in hosts))


# -- the supervisor ------------------------------------------------------------------------
@dataclass
class Settings:
    """What `cgp launch` was asked: the most ranks and the fewest, the train command line
    (after `--`, without --snapshot), the snapshot prefix it writes, the hang rule."""
    ranks: int
    min_ranks: int
    train: list
    prefix: str
    resume: str = None          # the --snapshot of the command line, for the first launch
    weights: str = None         # its --weights, for a first launch from scratch
    hostfile: str = None
    hang_floor: float = 30.0
    start_timeout: float = 300.0


@dataclass
class Outcome:
    """How a launch ended: 'done', 'died', 'hung' or 'grow'; the rank and host that failed
    where known; the last iteration the heartbeat showed."""
    kind: str
    iteration: int
    rank: int = None
    host: str = None
    detail: str = ""
    code: int = 0


@dataclass
class Watch:
    """What the supervisor knows of the job running: when it started, the heartbeat's last
    Beat and when it changed, and the latest snapshot it wrote and when."""
    started: float
    beat: Beat = None
    progress: float = None       # when the heartbeat last changed
    snapshot: int = -1
    snapshot_at: float = None
    grow_after: int = None       # grow at the first snapshot past this iteration
    stderr: deque = field(default_factory=lambda: deque(maxlen=200))
    procs: dict = field(default_factory=dict)   # pid -> psutil.Process under mpirun, seen
    listed: float = 0.0          # when procs was last refreshed
    relay: threading.Thread = None   # passes mpirun's stderr on, into `stderr`
    origin: int = 0              # the iteration the launch starts from


class Supervisor:
    """Runs the job until it completes: each launch one mpirun; see the module."""

    def __init__(self, settings, log=print):
        self.s, self.log = settings, log
        self.hosts = read_hostfile(settings.hostfile) if settings.hostfile else None
        self.hosts_mtime = self._hostfile_mtime()
        self.excluded = set()        # hosts whose rank failed, until the host file changes
        self.ranks = self._capacity()
        folder = Path(f"{settings.prefix}_iter_0.caffemodel").parent
        try:   # the heartbeat and the host file of a launch go beside the snapshots
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CgpError(f"snapshot folder {folder}: {e.strerror or e}") from None
        self.folder = folder
        self.heartbeat = folder / f".{Path(settings.prefix).name or 'snapshots'}.heartbeat"
        self.longest_gap = 0.0       # the longest pause between heartbeats seen
        self.woken = False           # SIGUSR1 since the last look
        self.stopping = None         # a signal that ends the supervision
        self.job = None
        self.lost = 0.0
        self.changes = 0

    # -- sizes --------------------------------------------------------------------------
    def _hostfile_mtime(self):
        if not self.s.hostfile:
            return None
        try:
            return os.stat(self.s.hostfile).st_mtime_ns
        except OSError:
            return None

    def _capacity(self):
        """The ranks a launch may have now: --np, less the slots of hosts excluded."""
        if self.hosts is None:
            return self.s.ranks
        return min(self.s.ranks, sum(h.slots for h in self.hosts if h.name not in self.excluded))

    def timeout(self):
        return max(self.s.hang_floor, HANG_FACTOR * self.longest_gap)

    # -- one launch ---------------------------------------------------------------------
    def command(self, resume):
        """The mpirun argv and environment of a launch on self.ranks ranks."""
        from cgp.comm import mpi

        train = list(self.s.train) + ["--heartbeat", str(self.heartbeat)]
        if resume is not None:
            train += ["--snapshot", str(resume)]
        elif self.s.weights is not None:
            train += ["--weights", self.s.weights]
        argv, env = mpi.local_job(self.ranks, ["-m", "cgp", *train])
        env["PYTHONUNBUFFERED"] = "1"   # rank 0's lines reach the log as they are printed
        if self.hosts is not None:
            hostfile = self.folder / f".{Path(self.s.prefix).name}.hosts"
            write_hostfile(hostfile, [h for h in self.hosts if h.name not in self.excluded])
            argv[1:1] = ["--hostfile", str(hostfile)]
            env.pop("OMPI_MCA_btl", None)   # shared memory alone reaches no other host
        return argv, env

    def start(self, resume):
        self.heartbeat.unlink(missing_ok=True)
        argv, env = self.command(resume)
        watch = Watch(started=time.monotonic(), origin=resume_iteration(resume) or 0)
        self.job = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True,
                                    errors="replace")
        watch.relay = threading.Thread(target=_relay, args=(self.job.stderr, watch.stderr),
                                       daemon=True)
        watch.relay.start()
        return watch

    def watch(self, w):
        """Waits until the job ends, hangs, or may grow at a snapshot: its Outcome."""
        while True:
            now = time.monotonic()
            self._look(w, now)
            if now - w.listed > LIST_SECONDS:
                self._list(w, now)
            code = self.job.poll()
            if code is not None:
                self._look(w, time.monotonic())
                self._end_leftovers(w)
                w.relay.join(timeout=5)   # mpirun's last words, which name the failed rank
                return self._ended(w, code)
            if self.stopping is not None:
                return self._stop(w)
            quiet = now - (w.progress if w.progress is not None else w.started)
            # Before the first heartbeat the ranks start; after the last, they exit.
            starting = w.progress is None or w.beat.finished
            limit = self.s.start_timeout if starting else self.timeout()
            if quiet > limit:
                return self._hung(w, quiet)
            if self.woken or self._hostfile_mtime() != self.hosts_mtime:
                self.woken = False
                self._regrow(w)
            if w.grow_after is not None and w.snapshot > w.grow_after:
                self._kill()
                self._end_leftovers(w)
                return Outcome("grow", w.snapshot)
            time.sleep(POLL_SECONDS)

    def _look(self, w, now):
        beat = read_beat(self.heartbeat)
        if beat is None or (w.beat is not None and beat.count == w.beat.count):
            return
        if w.progress is not None:
            self.longest_gap = max(self.longest_gap, now - w.progress)
        w.beat, w.progress = beat, now
        if beat.snapshot > w.snapshot:
            w.snapshot, w.snapshot_at = beat.snapshot, now

    def _list(self, w, now):
        """Notes the processes under mpirun on this machine: the ranks and their workers."""
        import psutil
        w.listed = now
        try:
            for proc in psutil.Process(self.job.pid).children(recursive=True):
                w.procs.setdefault(proc.pid, proc)
        except psutil.Error:
            pass

    def _stop(self, w):
        """Ctrl-C or SIGTERM to the supervisor: SIGTERM to the ranks on this machine, which
        stop after one same iteration with a snapshot (cgp train's --sigterm-effect); with a
        host file, to mpirun, which ends the job (Open MPI aborts it: the last snapshot
        stays). Waits for the job to end, or kills it after STOP_SECONDS."""
        import psutil
        self._list(w, time.monotonic())
        if self.hosts is not None:
            self.job.send_signal(signal.SIGTERM)
        for proc in w.procs.values():
            try:
                if "OMPI_COMM_WORLD_RANK" in proc.environ():
                    proc.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
        try:
            code = self.job.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self._kill()
            code = self.job.wait()
        self._end_leftovers(w)
        self._look(w, time.monotonic())
        return Outcome("stopped", self._iteration(w), code=code)

    def _end_leftovers(self, w):
        """SIGKILL to what is left of the job's processes once mpirun has ended (its ranks
        are ended by it, but not always before it exits), so that none still holds the
        snapshot prefix's lock, or the CPU, when the next launch starts."""
        import psutil
        alive = []
        for proc in w.procs.values():
            try:
                if proc.is_running():   # the same process (its start time), not a new one
                    proc.kill()
                    alive.append(proc)
            except psutil.Error:
                pass
        # Gone, or zombies that only their parent's reaping removes (not ours to wait for).
        deadline = time.monotonic() + 10
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _running(p)]
            time.sleep(POLL_SECONDS)

    def _iteration(self, w):
        """The iteration the heartbeat last showed; without one, that of the launch's start."""
        return w.beat.iteration if w.beat is not None else w.origin

    def _ended(self, w, code):
        if code == 0:
            return Outcome("done", self._iteration(w))
        text = " ".join(" ".join(w.stderr).split())
        # Open MPI's words for a rank that ended without MPI's abort: 'process rank R with
        # PID P on node H exited on signal 9 (Killed)' (or '... exited with status S').
        match = re.search(r"rank (\d+) with PID \d+ on node (\S+?)\.? exited on signal (\d+)",
                          text)
        if match is not None:
            return Outcome("died", self._iteration(w), int(match[1]), match[2],
                           f"signal {match[3]}", code)
        if "cgp: error:" in text:   # the trainer refused or failed by itself: no relaunch
            return Outcome("error", self._iteration(w), code=code)
        match = re.search(r"rank (\d+) with PID \d+ on node (\S+?)\.? exited", text)
        return Outcome("died", self._iteration(w), int(match[1]) if match else None,
                       match[2] if match else None, f"mpirun exit status {code}", code)

    def _hung(self, w, quiet):
        stopped = self._kill()
        self._end_leftovers(w)
        rank, host = stopped[0] if stopped else (None, None)
        what = (f"no heartbeat for {quiet:.1f} s (limit {self.timeout():.1f} s)"
                if w.progress is not None and not w.beat.finished else
                f"no {'first' if w.progress is None else 'exit'} {quiet:.1f} s after the "
                f"{'launch' if w.progress is None else 'last heartbeat'}")
        if rank is not None:
            what += f"; rank {rank} was stopped"
        return Outcome("hung", self._iteration(w), rank, host, what)

    def _kill(self):
        """Ends the job at once: SIGKILL to every process under mpirun on this machine (a
        stopped one too: SIGKILL needs no cooperation), then to mpirun, whose daemons on
        other hosts then end their ranks. Returns [(rank, host)] of the ranks found
        stopped."""
        import psutil
        stopped = []
        try:
            procs = psutil.Process(self.job.pid).children(recursive=True)
        except psutil.Error:
            procs = []
        for proc in procs:
            try:
                if proc.status() == psutil.STATUS_STOPPED:
                    rank = proc.environ().get("OMPI_COMM_WORLD_RANK")
                    if rank is not None:
                        stopped.append((int(rank), _local_host()))
                proc.kill()
            except psutil.Error:
                pass
        self.job.kill()
        self.job.wait()
        return sorted(stopped)

    def _regrow(self, w):
        """SIGUSR1 or a changed host file: ranks may have come back; grow at the job's next
        snapshot where there is room for more."""
        if self.hosts is not None:
            self.hosts_mtime = self._hostfile_mtime()
            try:
                self.hosts = read_hostfile(self.s.hostfile)
            except CgpError as e:   # a file being edited: the hosts as they were
                self.log(f"cgp launch: {e}; the hosts stay as they were")
            self.excluded.clear()
        more = self._capacity()
        if more > self.ranks and w.grow_after is None:
            w.grow_after = w.snapshot
            self.log(f"cgp launch: {more} ranks available: growing from {self.ranks} at the "
                     "next snapshot")

    # -- the whole run ------------------------------------------------------------------
    def run(self):
        from cgp.snapshot import lock_prefix
        # One supervisor per prefix: a second would take over the first one's heartbeat
        # (its own job is refused by the trainer's lock on the prefix itself).
        lock = lock_prefix(f"{self.s.prefix}.launch")
        try:
            return self._run()
        finally:
            if lock is not None:
                lock.release()

    def _run(self):
        resume = self.s.resume
        fruitless = 0
        old = {s: signal.signal(s, self._signal) for s in (signal.SIGUSR1, signal.SIGINT,
                                                             signal.SIGTERM)}
        began = time.monotonic()
        try:
            self.log(f"cgp launch: {self.ranks} ranks (at least {self.s.min_ranks})"
                     + (f" on {_hosts_text(self.hosts, self.excluded)}" if self.hosts else
                        " on this machine")
                     + f"; a rank hangs after {self.s.hang_floor:g} s without a heartbeat, or "
                       f"{HANG_FACTOR} times the longest pause between heartbeats if longer")
            while True:
                w = self.start(resume)
                outcome = self.watch(w)
                if outcome.kind == "done":
                    self.heartbeat.unlink(missing_ok=True)
                    self.log(f"cgp launch: done at iteration {outcome.iteration} on "
                             f"{self.ranks} ranks in {time.monotonic() - began:.1f} s; "
                             f"{self.changes} change(s) of size, {self.lost:.1f} s of work lost")
                    return 0
                if outcome.kind == "stopped":
                    self.log(f"cgp launch: stopped by {signal.Signals(self.stopping).name} at "
                             f"iteration {outcome.iteration}"
                             + (f"; the last snapshot is {_state_path(self.s.prefix, w.snapshot)}"
                                if w.snapshot >= 0 else ""))
                    return outcome.code
                if outcome.kind == "error":
                    return outcome.code or 1
                if w.snapshot >= 0:
                    resume = _state_path(self.s.prefix, w.snapshot)
                    fruitless = 0
                else:
                    fruitless += 1
                since = w.snapshot_at if w.snapshot >= 0 else w.started
                lost = time.monotonic() - since
                old_ranks = self.ranks
                why = self._resize(outcome, w)
                self.lost += lost
                self.changes += 1
                start_at = resume_iteration(resume)
                self.log(f"cgp launch: iteration {outcome.iteration}: {why}; ranks {old_ranks} "
                         f"-> {self.ranks}; resuming from "
                         + (f"iteration {start_at} ({resume})" if resume else "the start")
                         + f"; {lost:.1f} s of work lost")
                if self.ranks < self.s.min_ranks or self.ranks < 1:
                    self.log(f"cgp launch: fewer than --min-ranks {self.s.min_ranks} left: "
                             "stopping" + (f"; resume later from {resume}" if resume else ""))
                    return 1
                if fruitless >= MAX_FRUITLESS:
                    self.log(f"cgp launch: {fruitless} launches in a row failed before a new "
                             "snapshot: giving up")
                    return 1
        finally:
            for signum, handler in old.items():
                signal.signal(signum, handler)
            if self.job is not None and self.job.poll() is None:
                self._kill()

    def _resize(self, outcome, w):
        """Sets the rank count of the next launch after `outcome`; returns why, in words.
        A rank that died or was found stopped costs one rank, or with a host file its
        host; a failure that names no rank (a hang with every rank running, a launch that
        failed before its first heartbeat) changes nothing: the next launch is the same."""
        if outcome.kind == "grow":
            self.ranks = self._capacity()
            return "ranks came back"
        if outcome.rank is None:
            what = "the job hung" if outcome.kind == "hung" else "the launch failed"
            return f"{what} ({outcome.detail}), naming no rank"
        if self.hosts is not None and outcome.host in {h.name for h in self.hosts}:
            self.excluded.add(outcome.host)
            self.ranks = self._capacity()
            return f"rank {outcome.rank} on {outcome.host} {outcome.kind} ({outcome.detail})"
        self.ranks = min(self.ranks - 1, self._capacity())   # a host named otherwise
        return f"rank {outcome.rank} {outcome.kind} ({outcome.detail})"

    def _signal(self, signum, frame):
        if signum == signal.SIGUSR1:
            self.woken = True
        else:
            self.stopping = signum


def _relay(stream, tail):
    """Passes mpirun's stderr on, keeping its last lines (the failed rank's message)."""
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        tail.append(line)


def _running(proc):
    import psutil
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _local_host():
    import socket
    return socket.gethostname()


def _hosts_text(hosts, excluded):
    return ", ".join(f"{h.name} ({h.slots})" for h in hosts if h.name not in excluded)


def _state_path(prefix, iteration):
    return Path(f"{prefix}_iter_{iteration}.solverstate")


def resume_iteration(path):
    """The iteration in a snapshot's name, else None."""
    match = re.search(r"_iter_(\d+)\.solverstate", str(path)) if path else None
    return int(match[1]) if match else None


def young_interval(step, snapshot, mtbf):
    """Seconds between snapshots that waste the least expected time (Young, 1974: the
    snapshot's own time against half an interval recomputed per failure):
    sqrt(2 x snapshot x MTBF), at least 10 steps and one second."""
    return max((2 * snapshot * mtbf) ** 0.5, 10 * step, 1.0)
