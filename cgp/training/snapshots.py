"""A training's snapshots: when they are due (every `snapshot` iterations; at the end with
snapshot_after_train), where they go (one run per prefix, which it holds locked), and the
writing of a pair. The files' format is cgp.snapshot's; what a pair holds comes from the
trainer (Trainer.resume_state), and restore() puts it back."""
import time
from pathlib import Path

from cgp.errors import CgpError
from cgp.proto import caffe_pb2
from cgp.snapshot import (lock_prefix, read_solverstate, recover_snapshot, recover_snapshots,
                          snapshot_paths, writable_folder, write_snapshot)
from cgp.training.solver_files import resolve
from cgp.training.triggers import until


class Snapshots:
    """The snapshots of one trainer: every `snapshot` iterations, and with --snapshot-seconds
    also once that long has passed since the last (time_due)."""

    def __init__(self, sp, config, solver_path, heartbeat=None):
        self.interval = sp.snapshot
        self.seconds = config.snapshot_seconds
        self.heartbeat = heartbeat   # cgp.comm.elastic.Heartbeat: told of each snapshot
        self.clock = time.monotonic()   # when the last snapshot was written
        self.after_train = sp.snapshot_after_train
        self.h5 = sp.snapshot_format == caffe_pb2.SolverParameter.HDF5
        prefix = config.snapshot_prefix or sp.snapshot_prefix
        if not prefix and solver_path:
            prefix = str(Path(solver_path).with_suffix(""))
        self.prefix = prefix or "cgp"
        self.held = False        # hold() has run
        self.lock = None         # this run's share of its prefix's lock
        self.last_iter = None    # the iteration of the latest snapshot written

    def due(self, count):
        """After a steps() call: at a multiple of `snapshot` (triggers.Count). The trigger by
        time is time_due, agreed across ranks as a signal's request."""
        return count.reached(self.interval)

    def until(self, it):
        return until(it, self.interval)

    def time_due(self, leader):
        """Whether --snapshot-seconds have passed since the last snapshot, by the leader's
        clock alone: raised as a signal's request, so every rank snapshots at the same
        iteration (Signals.agree)."""
        return (self.seconds is not None and leader
                and time.monotonic() - self.clock >= self.seconds)

    def due_after_train(self, it):
        """snapshot_after_train's, unless one was written at this very iteration."""
        return (self.after_train and (not self.interval or it % self.interval != 0)
                and self.last_iter != it)

    def check_folder(self, it):
        """Before training: a folder that cannot take the snapshots is found out now."""
        if self.interval or self.after_train:
            writable_folder(f"{self.prefix}_iter_{it}.caffemodel")

    def hold(self, log):
        """One run per snapshot prefix: takes its lock (snapshot.lock_prefix) for as long as
        this trainer runs, before it can write a snapshot (solve, snapshot), so that a
        second run is refused (CgpError naming the first) and a trainer that never writes
        one (equivalence, bench) takes none; then finishes or removes what an interrupted
        run left half written there. Once."""
        if not self.held:
            self.held = True
            self.lock = lock_prefix(self.prefix)
            recover_snapshots(self.prefix, log)

    def write(self, trainer):
        """Trainer.snapshot: the pair of trainer.iter, from the leader process alone; every
        process of the leader's group takes part (each holds its columns' histories: MPI).
        Returns the model's path, None outside the leader's group."""
        comm, it = trainer.comm, trainer.iter
        if not comm.leader_group:
            return None
        pending = trainer.train_step.pending(it)
        for array in trainer.solver.histories + [gradient for _, gradient in pending]:
            comm.collect(array)
        model, state = snapshot_paths(self.prefix, it, self.h5)
        if comm.leader:
            self.hold(trainer.log)
            started = time.monotonic()
            model = write_snapshot(self.prefix, it, trainer.net, trainer.solver,
                                   resume=trainer.resume_state(), h5=self.h5)
            self.clock = time.monotonic()
            if self.heartbeat is not None:
                self.heartbeat.snapshot(it, self.clock - started)
        kind = "HDF5" if self.h5 else "binary proto"
        trainer.log(f"Snapshotting to {kind} file {model}")
        trainer.log(f"Snapshotting solver state to {kind} file {state}")
        self.last_iter = it
        return model

    def release(self):
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def restore(trainer, path):
    """Trainer.restore: resumes the trainer from a .solverstate and the .caffemodel it names
    (its learned_net, relative to the working directory as in Caffe, else to the
    .solverstate's folder).

    A cgp .solverstate continues exactly: iteration, solver history, seed, data
    position and loss window all come back. One that Caffe wrote restores the
    iteration, history and learning-rate schedule, and the data restarts at the
    first record, as `caffe train --snapshot` does."""
    t, log = trainer, trainer.log
    recover_snapshot(path, log)   # a commit of this very pair that a kill cut short
    state, resume = read_solverstate(path, t.solver, t.net)
    if state.learned_net:
        weights = resolve(state.learned_net, Path(path).parent, "learned_net of the solver state")
        t.load_weights(weights, quiet=True)
    else:
        log(f"Note: {path} names no weights file (its learned_net is empty): the "
            "weights start from the net's fillers")
    t.iter = t.restored_iter = state.iter
    if resume is None:
        t.data_origin = state.iter
        log(f"{path} holds no cgp resume record (Caffe wrote it): the data restarts at "
            "the first record, as in Caffe")
        return
    t.data_origin = resume.data_origin
    t.losses = list(resume.recent_loss)[-max(1, t.sp.average_loss):]
    restore_pending(t.train_step, t.iter, path, resume)
    if resume.HasField("seed") and resume.seed != t.seed:
        log(f"Resuming with the snapshot's seed {resume.seed} (not {t.seed}), so "
            "that the run continues as it would have")
        t.seed = resume.seed
    if resume.chunks and resume.chunks != len(t.engine.bounds):
        log(f"Warning: the snapshot was trained with {resume.chunks} chunks per batch, "
            f"this run uses {len(t.engine.bounds)}: it continues with different "
            f"rounding, not bit for bit (use --chunks {resume.chunks})")


def restore_pending(step, it, path, resume):
    """The gradients a run with staleness had made and not applied yet at iteration `it`,
    from a .solverstate's resume record into the step's slots (cgp.step)."""
    if resume.staleness != step.staleness:
        raise CgpError(f"{path} was written with --staleness {resume.staleness}; resume it "
                       f"with the same (this run has {step.staleness})")
    want = [j for j, _ in step.pending(it)]
    if [g.iteration for g in resume.stale_gradient] != want:
        raise CgpError(f"{path}: the gradients pending at iteration {it} should be "
                       f"those of iterations {want}; it holds "
                       f"{[g.iteration for g in resume.stale_gradient]}")
    for (_, slot), stored in zip(step.pending(it), resume.stale_gradient):
        if len(stored.value) != slot.size:
            raise CgpError(f"{path}: a pending gradient of {len(stored.value)} values for "
                           f"{slot.size} parameters")
        slot[...] = stored.value
