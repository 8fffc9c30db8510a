"""`cgp time`: Caffe's `caffe time` for cgp: the average forward and backward milliseconds of
every layer and of a whole iteration, and a note when Numba compiles cgp's kernels.

Per-layer times come from Net.forward/backward with their clock, run single-threaded over
the chunks of the batch in the calls that one engine thread makes (see engine.group_size).
Each layer's time is the sum over the calls.
"""
import time
from contextlib import contextmanager

COMPILING = ("compiling kernels (first run only: for these sources, this Numba and this CPU; "
             "cached afterwards; `cgp compile` does it ahead of time)")
# A progress line at least this often while kernels compile (and every `every` kernels).
PROGRESS_SECONDS = 5.0


def add_time(sub):
    from cgp.options import add_denormals_option, add_workers_option
    p = sub.add_parser(
        "time", help="time forward and backward of every layer (Caffe's `caffe time`)",
        description="Average forward and backward milliseconds per layer and per iteration, "
                    "in Caffe's format. Layers are timed single-threaded over the chunks of "
                    "the batch; the engine's own iteration time on --threads follows.")
    p.add_argument("--model", required=True, help="net prototxt (Caffe's format)")
    p.add_argument("--iterations", type=int, default=50, help="iterations to time (default 50)")
    p.add_argument("--threads", type=int, default=1,
                   help="workers for the engine's whole-iteration time (default 1)")
    add_workers_option(p)
    p.add_argument("--chunks", type=int, default=16,
                   help="fixed pieces each batch is cut into (default 16)")
    add_denormals_option(p)
    p.add_argument("--phase", choices=("TRAIN", "TEST"), default="TRAIN",
                   help="the net's phase (default TRAIN)")
    p.add_argument("--level", type=int, default=0, help="the net state's level (default 0)")
    p.add_argument("--stage", action="append", default=[], help="a net state stage (repeatable)")
    p.add_argument("--seed", type=int, default=1701,
                   help="seed of the weights and of random Input data (default 1701)")
    p.add_argument("--data-dir", default=None,
                   help="folder holding the data set (overrides CGP_DATA_DIR and the bundled copy)")
    p.add_argument("--no-download", action="store_true", help="never download a missing data set")
    p.set_defaults(run=cmd_time)


@contextmanager
def denormals(flush):
    """The layers run in this thread with subnormals flushed (or not), as engine workers do."""
    from cgp.runtime import fpenv
    state = fpenv.set_flush(flush)
    try:
        yield
    finally:
        fpenv.restore(state)


# -- the first-run note --------------------------------------------------------------
@contextmanager
def compile_notice(log, prefix="cgp.", every=10):
    """Inside the block, says with log when Numba compiles (rather than loads from its cache)
    kernels from modules whose name starts with `prefix`: COMPILING at the first; at every
    `every`-th, or PROGRESS_SECONDS after the last line, the count and the seconds so far
    and the kernel that compiles now; at the end how many took how long. How many will
    compile is known only once they have (a kernel compiles the kernels it calls, each
    counted), so no total is given while they do. Numba announces exactly those
    compilations with its "numba:compile" event; cache hits raise no event. Yields the
    listener, whose `seconds` is the compile time so far, for a speed that leaves it out
    (Trainer.clock)."""
    from numba.core import event

    class Listener(event.Listener):
        count = 0          # cgp kernels compiled
        seconds = 0.0      # seconds spent compiling, anything (nested compiles once)
        depth = 0
        started = 0.0
        said = 0.0         # when the last progress line was logged

        def on_start(self, ev):
            # Numba compiles under one lock: the events of a process nest, never overlap.
            now = time.perf_counter()
            if self.depth == 0:
                self.started = now
            self.depth += 1
            dispatcher = ev.data.get("dispatcher") if isinstance(ev.data, dict) else None
            py_func = getattr(dispatcher, "py_func", None)
            module = getattr(py_func, "__module__", "") or ""
            if not module.startswith(prefix):
                return
            if self.count == 0:
                log(COMPILING)
                self.said = now
            self.count += 1
            if self.count % every == 0 or now - self.said >= PROGRESS_SECONDS:
                self.said = now
                log(f"compiling kernels: {self.count} so far, "
                    f"{self.seconds + now - self.started:.0f} s; now "
                    f"{module.removeprefix(prefix)}.{py_func.__qualname__}")

        def on_end(self, ev):
            self.depth -= 1
            if self.depth == 0:
                self.seconds += time.perf_counter() - self.started

    listener = Listener()
    event.register("numba:compile", listener)
    try:
        yield listener
    finally:
        event.unregister("numba:compile", listener)
    if listener.count:
        log(f"compiled {listener.count} kernels in {listener.seconds:.1f} s (cached for later "
            "runs)")


# -- the timed loops -------------------------------------------------------------------
def backward_plan(net):
    """Per entry (backward?, [propagate to bottom i?]). A net with a loss uses its own plan.
    A net without one (a deploy net) is timed as if every output had a loss, since Caffe's
    `caffe time` runs every layer's backward too: layers with learnable parameters upstream."""
    if net.loss_weights:
        return [(e.backward, list(e.propagate)) for e in net.entries]
    needs = [False] * len(net.blob_names)
    plan = []
    for e in net.entries:
        learnable = any(net.param_blobs[p].lr_mult != 0 for p in e.params)
        flows = [needs[b] for b in e.bottoms]
        backward = (learnable or any(flows)) and not e.layer.reduces_batch
        plan.append((backward, flows if backward else [False] * len(flows)))
        for t in e.tops:
            needs[t] = backward
    return plan


def fill_inputs(net, seed):
    """Random data for Input layers: standard normal, except blobs read as labels (bottom 1
    of a loss or accuracy), which get random classes."""
    import numpy as np

    from cgp.layers.data import InputLayer

    rng = np.random.default_rng(seed)
    classes = {}
    split_of = {e.tops[j]: e.bottoms[0] for e in net.entries
                if e.layer.type_name == "Split" for j in range(len(e.tops))}
    for e in net.entries:
        if len(e.bottoms) == 2 and e.layer.type_name in ("SoftmaxWithLoss", "Accuracy"):
            label = split_of.get(e.bottoms[1], e.bottoms[1])
            classes[label] = net.blob_shapes[e.bottoms[0]][getattr(e.layer, "axis", 1)]
    for entry in net.sources:
        if isinstance(entry.layer, InputLayer):
            entry.layer.values = [
                rng.integers(0, classes[t], net.blob_shapes[t]).astype(np.float32)
                if t in classes else rng.standard_normal(net.blob_shapes[t]).astype(np.float32)
                for t in entry.tops]


def load_batch(net, iteration, seed, clock=None):
    """Source blob id -> whole-batch float32 array for `iteration`, as the trainer loads it;
    clock[i] += seconds in source i."""
    import numpy as np

    batch = {}
    for i, entry in enumerate(net.sources):
        started = time.perf_counter()
        arrays = entry.layer.load(iteration * net.batch_size, iteration, seed)
        for blob, array in zip(entry.tops, arrays):
            batch[blob] = np.asarray(array, np.float32)
        if clock is not None:
            clock[i] += time.perf_counter() - started
    return batch


class LayerTimer:
    """Times one net the way `caffe time` does, on cgp's per-chunk path."""

    def __init__(self, net, chunks, seed):
        import numpy as np

        from cgp.engine import chunk_bounds, group_size
        from cgp.net import Workspace

        self.net, self.seed = net, seed
        self.bounds = chunk_bounds(net.batch_size, chunks)
        group = group_size(net, chunks, 1)
        if net.forward_syncs or net.backward_syncs:   # its sums need the batch in one call
            group = len(self.bounds)
        self.calls = [self.bounds[c:c + group] for c in range(0, len(self.bounds), group)]
        self.plan = backward_plan(net)
        self.has_backward = any(b for b, _ in self.plan)
        self.ws = Workspace(net, max(sum(n for _, n in call) for call in self.calls),
                            with_diff=self.has_backward, parts=group,
                            part_max=max(n for _, n in self.bounds))
        if not net.loss_weights:  # a deploy net: a gradient of ones on every output
            read = {b for e in net.entries for b in e.bottoms}
            for blob, d in enumerate(self.ws.diff or []):
                if blob not in read:
                    d[...] = 1
        self.params = net.param_views(net.params)
        self.grads = np.zeros((group, net.n_params), np.float32)  # a row per part
        self.grad_views = [net.param_views(self.grads[:len(call)]) for call in self.calls]
        # The batch is copied here, so that each call's layer calls are bound once, as the
        # engine's are (Net.bind).
        self.inputs = {t: np.zeros(net.blob_shapes[t], np.float32) for t in net.source_names}
        self.batch_tops = net.batch_tops(self.inputs)
        self.bound = [None] * len(self.calls)
        self.forward = np.zeros(len(net.entries))
        self.backward = np.zeros(len(net.entries))
        self.data = np.zeros(len(net.sources))
        self.loss = None

    def iteration(self, iteration):
        """One forward-backward over all chunks: (forward seconds, backward seconds)."""
        from cgp.engine import call_chunk

        net = self.net
        started = time.perf_counter()
        for blob, array in load_batch(net, iteration, self.seed, self.data).items():
            self.inputs[blob][...] = array
        loss, t_forward, t_backward = 0.0, time.perf_counter() - started, 0.0
        for k, (call, grad_views) in enumerate(zip(self.calls, self.grad_views)):
            chunk = call_chunk(call, batch=net.batch_size, iteration=iteration, seed=self.seed,
                               batch_tops=self.batch_tops)
            if self.bound[k] is None:
                data = net.call_views(self.ws, chunk, self.inputs)
                self.bound[k] = net.bind(self.ws, chunk, data, self.params,
                                         grad_views if self.has_backward else None, self.plan)
            bound = self.bound[k]
            started = time.perf_counter()
            bound.forward(chunk, self.forward)
            t_forward += time.perf_counter() - started
            loss += sum(w * float(bound.data[b][:len(call)].sum())
                        for b, w in net.loss_weights.items())
            if self.has_backward:
                self.grads.fill(0)
                started = time.perf_counter()
                bound.backward(chunk, self.backward)
                t_backward += time.perf_counter() - started
        self.loss = loss
        return t_forward, t_backward

    def reset(self):
        self.forward[:] = 0
        self.backward[:] = 0
        self.data[:] = 0


def engine_time(net, threads, chunks, iterations, seed, flush_denormals=True,
                workers="threads"):
    """Wall-clock milliseconds per forward-backward of the real engine on `threads` workers,
    run as `workers` ("threads" or "processes", as cgp train's; gradient reduction
    included). With processes, net.params moves into shared memory."""
    from cgp.comm import make_communicator
    from cgp.device import make_engine
    from cgp.runtime.procs import make_pool

    pool = make_pool(workers, threads, [net], flush_denormals=flush_denormals)
    try:
        engine = make_engine(None, net, chunks, pool, make_communicator(pool),
                             backward=bool(net.loss_weights))
        pool.start()
        engine.run(load_batch(net, 0, seed), 0, seed)  # warm-up
        total = 0.0
        for it in range(iterations):
            started = time.perf_counter()
            engine.run(load_batch(net, it, seed), it, seed)
            total += time.perf_counter() - started
    finally:
        pool.close()
    return 1e3 * total / iterations


# -- the command -------------------------------------------------------------------
def cmd_time(args, log=print):
    from threadpoolctl import threadpool_limits

    from cgp.options import worker_kind
    from cgp.errors import CgpError
    from cgp.net import RunOptions, build_net
    from cgp.runtime.procs import worker_noun
    from cgp.proto import caffe_pb2
    from cgp.prototxt import read_model

    if args.iterations < 1:
        raise CgpError(f"--iterations must be at least 1, got {args.iterations}")
    if args.threads < 1:
        raise CgpError(f"--threads must be at least 1, got {args.threads}")
    phase = caffe_pb2.TRAIN if args.phase == "TRAIN" else caffe_pb2.TEST
    net = build_net(read_model(args.model), args.model, phase,
                    RunOptions(args.data_dir, not args.no_download), stages=args.stage,
                    level=args.level)
    net.init_params(args.seed)
    fill_inputs(net, args.seed)
    timer = LayerTimer(net, args.chunks, args.seed)
    log(f"cgp time: net '{net.name}' ({args.model}), phase {args.phase}, batch "
        f"{net.batch_size} in {len(timer.bounds)} chunks, layers timed on 1 thread in "
        f"{len(timer.calls)} call(s) per iteration")
    if not net.loss_weights and timer.has_backward:
        log("The net has no loss: backward is timed with a gradient of ones on every output, "
            "as if each had a loss.")
    flush = args.denormals == "flush"
    with threadpool_limits(limits=1), compile_notice(log), denormals(flush):
        log("Performing Forward-Backward (warm-up)")
        timer.iteration(0)
        if net.loss_weights:
            log(f"Initial loss: {timer.loss:.6g}")
        timer.reset()
        log("*** Benchmark begins ***")
        log(f"Testing for {args.iterations} iterations.")
        t_forward = t_backward = 0.0
        for it in range(args.iterations):
            f, b = timer.iteration(it + 1)
            t_forward, t_backward = t_forward + f, t_backward + b
            log(f"Iteration: {it + 1} forward-backward time: {1e3 * (f + b):.3f} ms.")
        log("Average time per layer: ")
        per = 1e3 / args.iterations
        names = ([e.layer.name for e in net.sources] + [e.layer.name for e in net.entries])
        width = max(10, max(len(n) for n in names))
        rows = ([(e.layer.name, t, 0.0) for e, t in zip(net.sources, timer.data)]
                + [(e.layer.name, f, b) for e, f, b in zip(net.entries, timer.forward,
                                                         timer.backward)])
        for name, f, b in rows:
            log(f"{name:>{width}}  forward: {per * f:.4f} ms.")
            log(f"{name:>{width}}  backward: {per * b:.4f} ms.")
        log(f"Average Forward pass: {per * t_forward:.3f} ms.")
        log(f"Average Backward pass: {per * t_backward:.3f} ms.")
        log(f"Average Forward-Backward: {per * (t_forward + t_backward):.3f} ms.")
        log(f"Total Time: {1e3 * (t_forward + t_backward):.1f} ms.")
        workers = worker_kind(args.workers)
        engine_ms = engine_time(net, args.threads, args.chunks, args.iterations, args.seed,
                                flush, workers)
        log(f"Average Forward-Backward, engine on {args.threads} "
            f"{worker_noun(workers, args.threads)}: {engine_ms:.3f} ms "
            f"({1e3 * net.batch_size / engine_ms:.0f} images/s).")
    log("*** Benchmark ends ***")
    return 0
