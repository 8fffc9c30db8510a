"""Caffe's solver loop around the engine. Set-up: the nets, the workers, the solver, the
engine and the loop's units (cgp.training: tests, display, snapshots, signals; the memory
check and the divergence message). Then the loop: the steps up to the next test, snapshot
or the end, each followed by the display and the signals' agreed request; at a boundary,
the test or the snapshot. The Solver does the arithmetic, the Engine runs the chunks.

Every source of randomness is a pure function of (seed, iteration, ...), and the data
position is a pure function of the iteration, so a run resumed from a snapshot
continues bit for bit as if it had not stopped. cgp's .solverstate carries what Caffe's
lacks for that (seed, data position, chunks; see cgp/proto/cgp.proto); a .solverstate
that Caffe wrote resumes as Caffe resumes, with the data back at the first record.
"""
import time

from threadpoolctl import threadpool_limits

from cgp.comm import make_communicator, make_schedule
from cgp.comm.elastic import Heartbeat
from cgp.device import make_engine, make_step, select_backend
from cgp.errors import CgpError
from cgp.net import RunOptions
from cgp.proto import cgp_pb2
from cgp.runtime.procs import make_pool
from cgp.snapshot import layers_without, load_weights
from cgp.solver import Solver
from cgp.step import Diverged
from cgp.training import divergence, memory
from cgp.training.config import RunConfig, worker_kind
from cgp.training.memory import WORKER_PROCESS_BYTES, check_memory   # noqa: F401  (*)
from cgp.training.progress import Progress, fmt, loss_note            # noqa: F401  (*)
from cgp.training.signals import REQUESTS, Signals                   # noqa: F401  (*)
from cgp.training.snapshots import Snapshots, restore
from cgp.training.solver_files import (build_nets, check_solver,   # noqa: F401  (*)
                                      resolve, weights_files)
from cgp.training.testing import PeriodicTests, copy_shared          # noqa: F401  (*)
from cgp.training.triggers import Count
# (*) Names that other modules import from cgp.train, where they were defined before.


class Trainer:
    """Trains one solver; `log` receives Caffe-style lines."""

    restored_iter = None   # the iteration of the .solverstate restored, if any
    weights_path = None    # the .caffemodel of the latest snapshot

    def __init__(self, sp, solver_path=None, config=RunConfig(), log=print):
        self.sp, self.config, self.log = sp, config, log
        self.solver_path = solver_path
        self.seed = check_solver(sp, solver_path, config, log)
        self.net, self.test_nets = build_nets(sp, solver_path,
                                              RunOptions(config.data_dir, config.download))
        self.net.init_params(self.seed)
        # The device first: a GPU is taken before any worker exists.
        self.backend = select_backend(config.device, config.device_id)
        self.workers = workers = worker_kind(config, self.backend, [self.net, *self.test_nets], log)
        self.pool = make_pool(workers, config.threads, [self.net] + self.test_nets,
                              config.affinity, config.denormals == "flush")
        # Histories in shared memory where workers write them (processes).
        self.solver = Solver(sp, self.net.lr_mult, self.net.decay_mult, self.pool.shared_memory,
                             [(b.offset, b.size) for b in self.net.param_blobs])
        self.comm = comm = make_communicator(self.pool, config.sharing, config.groups)
        self.schedule = make_schedule(comm)   # which iterations this process computes
        self.memory_line = memory.measure(self.net, config.chunks, self.pool,
                                          len(self.solver.histories), self.test_nets)
        self.engine = make_engine(self.backend, self.net, config.chunks, self.pool, comm)
        self.test_engines = [make_engine(self.backend, n, config.chunks, self.pool, comm,
                                         backward=False) for n in self.test_nets]
        self.train_step = make_step(self.engine, self.solver, comm, sp.iter_size,
                                    config.staleness)
        self.pool.start()   # workers forked once everything they run exists
        # The loop's units.
        self.tests = PeriodicTests(sp, self.test_nets, self.test_engines)
        self.heartbeat = Heartbeat(config.heartbeat) if config.heartbeat and comm.leader else None
        self.snapshots = Snapshots(sp, config, solver_path, self.heartbeat)
        self.signals = Signals(config.sigint_effect, config.sighup_effect, config.sigterm_effect)
        self.progress = Progress(self)
        self.iter = 0
        # The iteration whose batch starts at record 0: 0, or the iteration of a Caffe
        # .solverstate resumed from (Caffe's data layers start again at the first record).
        self.data_origin = 0
        self.max_iter = config.max_iter if config.max_iter is not None else sp.max_iter
        self.losses = []          # the window of Caffe's smoothed (average_loss) loss
        self.last_test = {}
        self.last_test_iter = None
        self.stopped = False      # a signal's stop was acted on
        self._ahead = None        # (what _batch was asked, the batch) read ahead by step()
        self.drained = False      # every iteration to max_iter is claimed (cgp.comm.sharing)
        self._from = 0            # the iteration count where the latest steps() began
        self.clock = time.perf_counter   # the display's speed; cgp train's leaves out compiling
        for path in weights_files(sp, solver_path):
            self.load_weights(path)

    # -- data ----------------------------------------------------------------------
    def _pass(self, it, k):
        """(record position, iteration number of the data) of pass k of training iteration
        it: iter_size passes per iteration, the data counted from the data origin."""
        size = self.sp.iter_size
        return ((it - self.data_origin) * size + k) * self.net.batch_size, it * size + k

    def _batch(self, engine, position, iteration):
        """Source blob id -> array of the engine's samples (Engine.rows: the whole batch but
        where other ranks compute the rest) of the batch at a record position: the one read
        ahead (_work_ahead) when it is that one."""
        key = (engine, position, iteration, self.seed)
        if self._ahead is not None and self._ahead[0] == key:
            batch, self._ahead = self._ahead[1], None
            return batch
        batch = {}
        for entry in engine.net.sources:
            arrays = entry.layer.load(position, iteration, self.seed, engine.rows)
            batch.update(zip(entry.tops, arrays))
        return batch

    def _work_ahead(self, it):
        """Iteration `it`'s first batch (read_ahead) and Step (Solver.prepare_ahead), made
        during the last run of the one before (Pool.run's `first`), not serially after it."""
        self._ahead = None
        if it is not None:   # None: no iteration left to claim (cgp.comm.sharing)
            self.solver.prepare_ahead(it)
            self.read_ahead(self.engine, *self._pass(it, 0))

    def read_ahead(self, engine, position, iteration):
        """A batch read early and staged (Engine.stage), for steps and test passes alike;
        _batch returns it only when asked for that very batch (a function of its position,
        iteration and seed). A data error is left to that request, which raises it."""
        self._ahead = None
        try:
            batch = self._batch(engine, position, iteration)
        except Exception:   # noqa: BLE001  (raised again where the batch is needed)
            return
        self._ahead = ((engine, position, iteration, self.seed), batch)   # as _batch asks
        engine.stage(batch)

    # -- one iteration -------------------------------------------------------------
    def step(self):
        """One training iteration: forward/backward, update, iter += 1."""
        return self.steps(1)

    def steps(self, n, each=None):
        """Up to n training iterations (DataParallelStep); returns the last one's (loss,
        outputs, rate). each(it, loss, outputs, rate), if given, is called after iteration
        `it` and ends the run early by returning True. The caller's work for the next
        iteration (its first batch and Step) runs during each iteration's last run, which
        would otherwise keep every worker waiting; the weights and the solver's histories
        are up to date once steps() has returned (cgp.device.step keeps them until then).
        Where groups of ranks share weights asynchronously (cgp.comm.sharing), the communicator
        says which iteration this process computes and what the count is after it (the
        updates of every group): steps run until the count has grown by n, or no iteration
        is left to claim (drained); `it` given to each() is then the count of the weights
        that the step's loss was computed on."""
        result, end = None, self.iter + n
        self._from = self.iter
        while self.iter < end:
            it = self.schedule.claim(self.iter, self.max_iter)
            if it is None:
                self.drained = True
                break
            try:
                result = self.train_step(
                    it, lambda k: self._pass_batch(it, k), self.seed,
                    first=lambda: self._work_ahead(self.schedule.claim_ahead(it + 1,
                                                                             self.max_iter)))
            except Diverged as d:
                raise CgpError(divergence.explain(d, self.net, self.seed,
                                                  *self._pass(d.iteration, d.index))) from None
            before, self.iter = self.iter, self.schedule.after(it)
            if each is not None and each(before, *result):
                break
        self.train_step.to_host()   # the device's weights, for what reads them now
        return result

    def _pass_batch(self, it, k):
        """(batch, iteration number of its data) of pass k of training iteration it."""
        position, iteration = self._pass(it, k)
        return self._batch(self.engine, position, iteration), iteration

    def test(self, index=0):
        """One test pass of test net `index`: (outputs averaged over test_iter batches, the
        loss likewise), or None when a signal asked to stop meanwhile (PeriodicTests.run_one)."""
        return self.tests.run_one(self, index)

    # -- the loop ------------------------------------------------------------------
    def solve(self):
        """Train to max_iter; returns the final test outputs (if any)."""
        if self.restored_iter is not None and self.iter >= self.max_iter:
            # Caffe would snapshot again, rewriting the files it resumed from.
            self.log(f"Note: resumed at iteration {self.iter}, max_iter is {self.max_iter}: "
                     "nothing to train; no snapshot written")
            return self.last_test
        if self.comm.leader:   # one run per prefix: the leader writes the job's snapshots
            self.hold_prefix()
            self.snapshots.check_folder(self.iter)
        # Where groups share weights (cgp.comm.sharing): the buffer starts from these weights.
        self.iter = self._from = self.schedule.begin(self.iter, self.net.params)
        self.snapshots.clock = time.monotonic()   # --snapshot-seconds count from here
        with threadpool_limits(limits=1), self.signals, self.progress:
            while self.iter < self.max_iter and not self.stopped:
                if self.tests.due(self.count()):
                    self.tests.run(self)
                    if self.stopped:   # Ctrl-C during the test: no more training, as Caffe
                        break
                # The iterations up to the next test, snapshot or the end, in one steps().
                self.steps(min(self.max_iter - self.iter, self.tests.until(self.iter),
                               self.snapshots.until(self.iter)), self._after_step)
                if self.drained:   # cgp.comm.sharing: the count once every group's updates are in
                    self.iter = self.schedule.end(self.iter, self.net.params)
                self.act_on_request(
                    snapshot_due=self.snapshots.due(self.count()))
            self.iter = self.schedule.end(self.iter, self.net.params)   # after a stop, likewise
            if self.snapshots.due_after_train(self.iter):
                self.snapshot()   # a stop asked meanwhile changes nothing
        if self.stopped:
            self.log("Optimization stopped early.")
            return self.last_test
        if self.sp.display and self.iter % self.sp.display == 0:
            self.progress.closing(self._closing_loss())
        # Caffe tests at the end only on a test_interval boundary; cgp always reports
        # the final weights' test results.
        if self.test_nets and self.last_test_iter != self.iter:
            with threadpool_limits(limits=1), self.signals:
                self.tests.run(self)
        self.log("Optimization stopped early." if self.stopped else "Optimization Done.")
        return self.last_test

    def count(self):
        """Where the training stands, for the units' triggers."""
        return Count(self.iter, self._from, self.drained)

    def _after_step(self, it, loss, outputs, rate):
        """solve()'s call after each iteration: the display, then the signals' request,
        agreed by every process: one ends the steps() call, to be acted on at once."""
        self.progress.after_step(it, loss, outputs, rate)
        if self.heartbeat is not None:
            self.heartbeat.beat(self.iter)
        if self.snapshots.time_due(self.comm.leader):   # --snapshot-seconds: as a request
            self.signals.request = max(self.signals.request, "snapshot", key=REQUESTS.index)
        return self.signals.agree(self.schedule, self.log) is not None

    def act_on_request(self, snapshot_due=False):
        """Takes what a signal asked for since the last call (Signals.agree): a snapshot is
        written (once, also when one is due anyway), a stop sets `stopped`."""
        request, self.signals.request = self.signals.agree(self.schedule, self.log), None
        if snapshot_due or request == "snapshot":
            self.snapshot()
        if request == "stop":
            self.stopped = True

    def _closing_loss(self):
        """The loss of Caffe's last display: the final weights on the next batch, one forward
        pass (the first of iter_size)."""
        with threadpool_limits(limits=1):
            position, iteration = self._pass(self.iter, 0)
            _, loss, _ = self.engine.run(self._batch(self.engine, position, iteration),
                                         iteration, self.seed)
        return loss

    # -- snapshots -----------------------------------------------------------------
    def hold_prefix(self):
        """Snapshots.hold: the snapshot prefix's lock, for as long as this trainer runs."""
        self.snapshots.hold(self.log)

    def snapshot(self):
        """Write <prefix>_iter_<N>.caffemodel and .solverstate (.caffemodel.h5 and
        .solverstate.h5 with snapshot_format HDF5), a pair that appears whole or not at all
        (snapshot.write_snapshot), from the leader process alone; returns the model's path
        (None outside the leader's group, which writes none: cgp.comm.sharing)."""
        model = self.snapshots.write(self)
        if model is not None:
            self.weights_path = model
        return model

    def resume_state(self):
        """What cgp's .solverstate adds to Caffe's to resume bit for bit (cgp.proto)."""
        return cgp_pb2.ResumeState(
            data_origin=self.data_origin, seed=self.seed, chunks=len(self.engine.bounds),
            recent_loss=self.losses, staleness=self.train_step.staleness,
            stale_gradient=[cgp_pb2.StaleGradient(iteration=j, value=gradient)
                            for j, gradient in self.train_step.pending(self.iter)])

    def restore(self, path):
        """Resume from a .solverstate and the .caffemodel it names (snapshots.restore): a
        cgp .solverstate continues bit for bit; one that Caffe wrote restores the
        iteration, history and learning-rate schedule, and the data restarts at the first
        record, as `caffe train --snapshot` does."""
        restore(self, path)

    def load_weights(self, path, quiet=False):
        copied = load_weights(self.net, path, None if quiet else self.log)
        missing = layers_without(self.net, copied)
        if missing and not quiet:
            self.log(f"Kept initial weights for: {', '.join(missing)}")

    def close(self):
        self.pool.close()
        self.snapshots.release()
        for net in [self.net] + self.test_nets:
            for entry in net.sources:
                if hasattr(entry.layer, "close"):
                    entry.layer.close()
