"""The headline guarantee: training is bitwise identical for any thread count, with
chunk counts that do not divide the batch, more threads than cores, and across a
snapshot and resume. Also the chunking and the fixed-order reduction themselves."""
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import pytest
from numba import njit

from cgp.comm.local import (ALONE, FactoredGrad, LocalCommunicator, ReferenceCommunicator,
                            blocks, reference_reduce, split, sum_block, uncovered)
from cgp.engine import Call, Engine, Sum, chunk_bounds, group_size
from cgp.commands.equivalence import compare, train_run
from cgp.errors import CgpError, NetError
from cgp.kernels.fc import add_outer_rows
from cgp.net import Net, RunOptions
from cgp.step import DataParallelStep
from cgp.proto import caffe_pb2
from cgp.prototxt import parse_net
from cgp.runtime import fpenv
from cgp.runtime.memory import aligned_zeros
from cgp.runtime.pool import Pool
from cgp.runtime.procs import forks, make_pool
from cgp.runtime.reduce import OUTER_PAD, sum_rows
from cgp.runtime.simd import SHAPES, choose
from cgp.solver import Solver
from cgp.train import RunConfig, Trainer

from bundled import solver
from conftest import quick_solver

THREADS = (1, 2, 3, 4, 7, 16)




def test_chunk_bounds_cover_the_batch_in_order():
    assert chunk_bounds(64, 16) == [(4 * i, 4) for i in range(16)]
    bounds = chunk_bounds(100, 16)
    assert sum(n for _, n in bounds) == 100 and len(bounds) == 16
    assert all(a + n == b for (a, n), (b, _) in zip(bounds, bounds[1:]))
    assert {n for _, n in bounds} == {6, 7}
    assert chunk_bounds(3, 16) == [(0, 1), (1, 1), (2, 1)]


@pytest.mark.parametrize("threads", [1, 3])
def test_tree_reduction_matches_reference_bitwise(threads):
    rng = np.random.default_rng(0)
    for k in (1, 2, 3, 5, 7, 16, 33):
        bufs = rng.standard_normal((k, 70001)).astype(np.float32)
        want = reference_reduce(bufs)
        pool = Pool(threads)
        got = LocalCommunicator(pool).reduce(bufs.copy())
        # Tasks cut at given columns too (the engine's layer boundaries): the same sums.
        cut = LocalCommunicator(pool).plan(bufs.copy(), (), cuts=(70000, 5, 33000, 0))
        pool.close()
        assert np.array_equal(got, want) and np.array_equal(cut(), want)
        # Columns per task, fewer the more chunks each column sums; ALONE times as many on
        # one worker, which has nothing to balance.
        width = sum_block(k, ALONE if threads == 1 else 1)
        assert [lo for lo, _ in cut.spans] == [
            a for lo, hi in ((0, 5), (5, 33000), (33000, 70000), (70000, 70001))
            for a in range(lo, hi, width)]
    # About SUM_ELEMENTS chunk-gradient elements a task, in whole tiles of the kernel.
    assert [sum_block(k) for k in (1, 2, 16, 33, 200)] == [131072, 65536, 8192, 3072, 1024]
    assert sum_block(16, ALONE) == 131072
    assert blocks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert split([(0, 10), (12, 20)], (7, 0, 3, 12, 15, 7)) == [(0, 3), (3, 7), (7, 10),
                                                                (12, 15), (15, 20)]


# (J, L) pairs for which runtime.simd.choose picks each tile shape, for 16 and 8 lanes.
FACTOR_SHAPES = [(1, 1), (1, 33), (4, 33), (4, 49), (7, 1), (9, 1), (1, 17), (4, 17),
                 (4, 25), (50, 70), (30, 130)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_factored_reduction_matches_materialised_chunk_gradients_bitwise(dtype):
    """A factored gradient summed by the communicator equals, bit for bit, the chunk
    gradients built the unfactored way (fc.add_outer_rows) and summed by the reference tree,
    for every register tile shape, chunk counts around the tree's groups, and any threads."""
    rng = np.random.default_rng(1)
    lanes = 64 // np.dtype(dtype).itemsize
    shapes_used = set()
    for batch, chunks in ((13, 5), (16, 16), (7, 3), (100, 16), (5, 1), (22, 11), (14, 7)):
        bounds = chunk_bounds(batch, chunks)
        k = len(bounds)
        starts = np.array([first for first, _ in bounds] + [batch], np.int64)
        for J, L in FACTOR_SHAPES:
            a = np.zeros(batch * J + OUTER_PAD, dtype)
            b = np.zeros(batch * L + OUTER_PAD, dtype)
            A, B = a[:batch * J].reshape(batch, J), b[:batch * L].reshape(batch, L)
            A[:] = rng.standard_normal(A.shape)
            B[:] = rng.standard_normal(B.shape)
            # Dense rows around the factored block, as in a real net's flat gradient.
            offset, size = 3, 3 + J * L + 5
            bufs = rng.standard_normal((k, size)).astype(dtype)
            for c, (first, n) in enumerate(bounds):
                add_outer_rows(A[first:first + n], B[first:first + n],
                               bufs[c, offset:offset + J * L].reshape(J, L), True)
            want = reference_reduce(bufs)
            shapes_used.add(choose(J, L, lanes, True))
            for threads in (1, 3):
                got = bufs.copy()
                got[1:, offset:offset + J * L] = np.nan  # never read: the factors stand in
                pool = Pool(threads)
                LocalCommunicator(pool).reduce(got, [FactoredGrad(offset, J, L, a, b, starts)])
                pool.close()
                assert np.array_equal(got[0], want), (batch, chunks, J, L, threads)
    assert shapes_used == set(SHAPES)
    assert uncovered(10, [FactoredGrad(2, 2, 2, None, None, None)]) == [(0, 2), (6, 10)]
    assert uncovered(4, [FactoredGrad(0, 2, 2, None, None, None)]) == []


FACTOR_NET = """
name: "factored"
layer { name: "data" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 10 dim: 3 dim: 4 } shape { dim: 10 } } }
layer { name: "rows" type: "InnerProduct" bottom: "x" top: "h"
        inner_product_param { num_output: 6 axis: 2 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "h" top: "h" }
layer { name: "t" type: "InnerProduct" bottom: "h" top: "z"
        inner_product_param { num_output: 5 transpose: true weight_filler { type: "xavier" }
                              bias_filler { type: "constant" value: 0.1 } } }
layer { name: "shared_a" type: "InnerProduct" bottom: "z" top: "u" param { name: "w" }
        inner_product_param { num_output: 5 bias_term: false weight_filler { type: "xavier" } } }
layer { name: "shared_b" type: "InnerProduct" bottom: "u" top: "v" param { name: "w" }
        inner_product_param { num_output: 5 bias_term: false weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "v" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_factored_engine_gives_the_unfactored_bits(dtype):
    """Factoring the weight gradients (rows per sample > 1, a transposed weight) changes no
    bit of the gradient; weights shared by two layers are not factored."""
    net = Net(parse_net(FACTOR_NET, "factored.prototxt"), caffe_pb2.TRAIN, RunOptions())
    net.init_params(3)
    assert [net.entries[i].layer.name for i in net.factorable] == ["rows", "t"]
    rng = np.random.default_rng(2)
    batch = {net.sources[0].tops[0]: rng.standard_normal((10, 3, 4)),
             net.sources[0].tops[1]: rng.integers(0, 5, 10).astype(np.float64)}
    params = net.params.astype(dtype)
    grads = []
    for factor in (False, True):
        for threads in (1, 2):
            pool = Pool(threads)
            engine = Engine(net, 4, pool, LocalCommunicator(pool), params=params, factor=factor)
            assert len(engine.factored) == (2 if factor else 0)
            values, loss, grad = engine.run(batch, 0, 1)
            grads.append(grad.copy())
            pool.close()
    assert np.count_nonzero(grads[0]) > 0.9 * grads[0].size
    for g in grads[1:]:
        assert np.array_equal(g, grads[0])


GROUP_NET = """
name: "grouped"
layer { name: "data" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 11 dim: 2 dim: 9 dim: 9 } shape { dim: 11 } } }
layer { name: "split" type: "Split" bottom: "x" top: "x1" top: "x2" }
layer { name: "c1" type: "Convolution" bottom: "x1" bottom: "x2" top: "c1a" top: "c1b"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1
                            weight_filler { type: "xavier" } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "sum" type: "Eltwise" bottom: "c1a" bottom: "c1b" top: "c1" }
layer { name: "pool" type: "Pooling" bottom: "c1" top: "p" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "c2" type: "Convolution" bottom: "p" top: "c2"
        convolution_param { num_output: 3 kernel_size: 2 stride: 2 bias_term: false
                            weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "c2" top: "c2" }
layer { name: "drop" type: "Dropout" bottom: "c2" top: "c2" }
layer { name: "fc" type: "InnerProduct" bottom: "c2" top: "f"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "shared_a" type: "InnerProduct" bottom: "f" top: "u" param { name: "w" }
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "shared_b" type: "InnerProduct" bottom: "u" top: "v" param { name: "w" }
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "fsplit" type: "Split" bottom: "v" top: "v1" top: "v2" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "v1" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "v2" bottom: "label" top: "acc" }
"""


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_grouped_calls_change_no_bit(dtype):
    """Running 1, 2, 3 or all chunks per layer call (uneven chunks and groups, both
    convolution paths, weights shared by two bottoms and by two layers, dropout, a loss and
    an accuracy) gives bitwise the same gradient, loss and accuracy."""
    net = Net(parse_net(GROUP_NET, "grouped.prototxt"), caffe_pb2.TRAIN, RunOptions())
    net.init_params(5)
    assert net.groupable
    rng = np.random.default_rng(4)
    batch = {net.sources[0].tops[0]: rng.standard_normal((11, 2, 9, 9)),
             net.sources[0].tops[1]: rng.integers(0, 5, 11).astype(np.float64)}
    params = net.params.astype(dtype)
    results = []
    for threads, group in ((1, 1), (1, 2), (2, 3), (1, 5), (2, None)):
        pool = Pool(threads)
        engine = Engine(net, 5, pool, LocalCommunicator(pool), params=params, group=group)
        assert len(engine.groups) == -(-5 // (group or group_size(net, 5, threads)))
        values, loss, grad = engine.run(batch, 2, 7)
        results.append((values, loss, grad.copy()))
        pool.close()
    assert np.count_nonzero(results[0][2]) > 0.5 * results[0][2].size
    for values, loss, grad in results[1:]:
        assert values == results[0][0] and loss == results[0][1]
        assert np.array_equal(grad, results[0][2])


def grouped_net_and_batch():
    net = Net(parse_net(GROUP_NET, "grouped.prototxt"), caffe_pb2.TRAIN, RunOptions())
    net.init_params(5)
    rng = np.random.default_rng(4)
    batch = {net.sources[0].tops[0]: rng.standard_normal((11, 2, 9, 9)).astype(np.float32),
             net.sources[0].tops[1]: rng.integers(0, 5, 11).astype(np.float32)}
    return net, batch


def before_first_layer(net, action):
    """Makes the backward of GROUP_NET's first convolution, the last layer a call's backward
    passes, run action(chunk) (the Chunk its calls were bound for: the call's samples)
    before its work, as the first of the kernel calls it hands over."""
    layer = next(e.layer for e in net.entries if e.layer.name == "c1")
    calls = layer.backward_calls

    def patched(*args):
        yield action, (args[-1],)
        yield from calls(*args)
    layer.backward_calls = patched


def hold_first_call(then=None):
    """An action for before_first_layer: in the call of the batch's first samples, sleep
    0.3 s, then run then() (if given): the other call is long done, and its worker sums
    gradients."""
    def hold(chunk):
        if chunk.first == 0:
            time.sleep(0.3)
            if then is not None:
                then()
    return hold


def sum_tasks(engine):
    """{reduction task: the entry it awaits} of an engine's Sum tasks."""
    return {t.task: t.after for t in engine.tasks if type(t) is Sum}


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_the_reduction_overlaps_backward_and_waits_for_every_call(workers):
    """The reduction's tasks run in the calls' run, each once every call has passed the
    layers whose gradients it sums: with one call's backward held up in the first layer,
    the other worker sums the later layers' gradients meanwhile, and the first layer's
    only after: the bits of one thread and of the naive reference communicator."""
    net, batch = grouped_net_and_batch()
    want = []
    for comm in (LocalCommunicator, ReferenceCommunicator):
        pool = Pool(1)
        want.append(Engine(net, 5, pool, comm(pool)).run(batch, 2, 7)[2].copy())
        pool.close()
    assert np.array_equal(want[0], want[1]) and np.count_nonzero(want[0]) > 0.5 * want[0].size
    before_first_layer(net, hold_first_call())
    pool = make_pool(workers, 2, [net])
    engine = Engine(net, 5, pool, LocalCommunicator(pool))
    summed = []   # (task, when) of each reduction task done, in the caller's memory
    task = engine.reduction.task
    if workers == "threads":
        engine.reduction.task = lambda w, i: (task(w, i), summed.append((i, time.perf_counter())))
    pool.start()
    try:
        started = time.perf_counter()
        grad = engine.run(batch, 2, 7)[2]
        took = time.perf_counter() - started
        assert np.array_equal(grad, want[0])
        awaited = sum_tasks(engine)
        first = min(awaited, key=awaited.get)   # a task of c1's columns
        if workers == "threads":
            done = dict(summed)
            assert len(done) == len(awaited)
            assert done[first] - started > 0.3   # after the held-up call
            assert min(done.values()) - started < 0.2   # others long before it
        assert took < 2
    finally:
        pool.close()


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_a_batch_staged_during_a_run_is_what_the_next_run_reads(workers):
    """Engine.stage, workers as threads or processes: the next batch, copied into the inputs
    during a run (its `first`), leaves that run's inputs alone, and the next run of that
    batch reads it without a copy; a run of another batch copies its own. The bits of
    unstaged runs."""
    net, batch = grouped_net_and_batch()
    rng = np.random.default_rng(9)
    batches = [batch] + [{b: rng.permutation(a) for b, a in batch.items()} for _ in range(2)]
    pool = Pool(1)
    engine = Engine(net, 5, pool, LocalCommunicator(pool))
    want = []
    for b in batches:
        values, loss, grad = engine.run(b, 2, 7)
        want.append((values, loss, grad.copy()))   # the engine's buffer, the next run's
    pool.close()

    def same(got, k):
        assert got[:2] == want[k][:2] and np.array_equal(got[2], want[k][2])

    def holds(slot, b):
        return all(np.array_equal(engine.inputs[slot][t], a) for t, a in b.items())
    pool = make_pool(workers, 2, [net])
    engine = Engine(net, 5, pool, LocalCommunicator(pool))
    pool.start()
    try:
        same(engine.run(batches[0], 2, 7, first=lambda: engine.stage(batches[1])), 0)
        read = engine._slot
        assert holds(read, batches[0]) and holds(1 - read, batches[1])
        copies = []
        copy_in = engine._copy_in
        engine._copy_in = lambda b: copies.append(b) or copy_in(b)
        same(engine.run(batches[1], 2, 7), 1)
        assert engine._slot == 1 - read and not copies   # read where it was staged
        engine.stage(batches[2])
        same(engine.run(batches[0], 2, 7), 0)   # not the batch staged: copied
        assert copies == [batches[2], batches[0]] and holds(engine._slot, batches[0])
    finally:
        pool.close()


def test_a_worker_lists_a_calls_kernel_calls_once_per_group_and_set_of_inputs():
    """Engine.work binds a call's layer calls (Net.bind) at the first call of its group on
    each set of inputs and keeps them: later runs make the same kernel calls without listing
    them again, and give the bits of an engine that has just bound them."""
    net, batch = grouped_net_and_batch()
    layer = next(e.layer for e in net.entries if e.layer.name == "c1")
    listed = []
    forward_calls = layer.forward_calls

    def counted(*args):
        listed.append(args[-1].first)
        return forward_calls(*args)
    layer.forward_calls = counted
    pool = Pool(1)
    engine = Engine(net, 5, pool, LocalCommunicator(pool), group=2)
    rng = np.random.default_rng(2)
    try:
        for it in range(6):   # each run copies its batch into the set the last did not read
            batch = {b: rng.permutation(a) for b, a in batch.items()}
            got = engine.run(batch, it, 7)
        assert len(engine.groups) == 3 and len(listed) == 2 * 3
        assert sorted(listed) == sorted(2 * [engine.samples(g)[0] for g in engine.groups])
        fresh = Engine(net, 5, pool, LocalCommunicator(pool), group=2)
        want = fresh.run(batch, 5, 7)
        assert got[:2] == want[:2] and np.array_equal(got[2], want[2])
    finally:
        pool.close()


def holds(net, e, lo, hi):
    """Whether a parameter of entry e lies in columns lo:hi of the flat parameters."""
    return any(net.param_blobs[p].offset < hi and lo < net.param_blobs[p].offset
               + net.param_blobs[p].size for p in net.entries[e].params)


def test_each_reduction_task_awaits_the_layers_of_its_columns_alone(mnist_dir):
    """The reduction's tasks are cut where the entries holding the parameters change, so
    that each awaits the layers whose gradients it sums and no earlier one (columns of
    layers sharing a block waited for the first of them, the last that backward passes);
    weights shared by two layers form a task of their own, awaited by both."""
    net, _ = grouped_net_and_batch()
    pool = Pool(2)
    engine = Engine(net, 5, pool, LocalCommunicator(pool))
    pool.close()
    holders = [[e for e in range(len(net.entries)) if holds(net, e, lo, hi)]
               for lo, hi in engine.reduction.spans]
    firsts = [[e for e in range(len(net.entries)) if holds(net, e, lo, lo + 1)]
              for lo, _ in engine.reduction.spans]
    assert holders == firsts
    assert sum(len(h) > 1 for h in holders) == 1   # the shared weights
    awaited = sum_tasks(engine)
    assert all(awaited[t] == holders[t][0] for t in awaited)
    # LeNet: conv2's columns no longer wait for conv1's backward.
    trainer = Trainer(solver("mnist"), None, RunConfig(threads=2, workers="threads",
                                                       data_dir=str(mnist_dir), progress=False),
                      log=lambda line: None)
    trainer.close()
    net, engine = trainer.net, trainer.engine
    awaited = sum_tasks(engine)
    names = [net.entries[awaited[t]].layer.name for t in sorted(awaited)]
    assert names[:2] == ["conv1", "conv2"] and names.count("conv1") == 1


def test_a_run_is_the_calls_then_the_sums_of_the_last_layers_first():
    """The engine's one list of tasks: every call, largest first, then one Sum per task of
    the communicator's reduction, those whose layers backward reaches first (the last) first;
    a forward-only engine has the calls alone."""
    net, _ = grouped_net_and_batch()
    pool = Pool(2)
    engine = Engine(net, 5, pool, LocalCommunicator(pool), group=2)
    forward = Engine(net, 5, pool, LocalCommunicator(pool), group=2, backward=False)
    pool.close()
    calls = [t for t in engine.tasks if type(t) is Call]
    sums = [t for t in engine.tasks if type(t) is Sum]
    assert engine.tasks == calls + sums and [c.group for c in calls] == [0, 1, 2]
    assert sorted(s.task for s in sums) == list(range(len(engine.reduction.spans)))
    assert [s.after for s in sums] == sorted((s.after for s in sums), reverse=True)
    assert forward.tasks == calls


def raised_within(seconds, fn, *args):
    """The exception that fn(*args) raises (None if it returns), run in a thread of its own
    so that a run that would wait forever fails the test after `seconds` instead."""
    raised = []

    def target():
        try:
            fn(*args)
        except BaseException as error:   # noqa: BLE001  (handed to the test)
            raised.append(error)
        else:
            raised.append(None)
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the run did not end within {seconds} s"
    return raised[0]


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_a_failed_call_ends_the_reduction_tasks_that_wait_for_it(workers):
    """A call that fails while the other worker waits in a reduction task for its progress:
    the run raises the call's error (not the waiting task's cancellation) and the pool goes
    on serving."""
    net, batch = grouped_net_and_batch()

    def fail():
        raise NetError("layer 'c1': made to fail")
    before_first_layer(net, hold_first_call(then=fail))
    pool = make_pool(workers, 2, [net])
    engine = Engine(net, 5, pool, LocalCommunicator(pool))
    pool.start()
    try:
        for _ in range(2):
            error = raised_within(20, engine.run, batch, 2, 7)
            assert isinstance(error, NetError) and "made to fail" in str(error)
    finally:
        pool.close()


def test_a_worker_that_dies_in_its_call_ends_the_waiting_run():
    """A worker process killed in its call's backward, while the caller waits in a
    reduction task for the gradients it would have written: the run ends with the error
    that names the worker, instead of waiting forever."""
    net, batch = grouped_net_and_batch()
    main = os.getpid()

    def die():
        if os.getpid() != main:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.3)   # in the caller's call: the worker, if late to start, takes the other
    before_first_layer(net, lambda chunk: die())
    pool = make_pool("processes", 2, [net])
    engine = Engine(net, 5, pool, LocalCommunicator(pool))
    pool.start()
    try:
        error = raised_within(20, engine.run, batch, 2, 7)
        assert isinstance(error, CgpError)
        assert "worker process 1 ended unexpectedly" in str(error)
    finally:
        pool.close()


def test_a_worker_waiting_for_progress_ends_when_the_main_process_is_killed():
    """The main process killed while its call (whichever it took) holds up the worker
    process, which waits in a reduction task: the orphaned worker ends instead of waiting
    for ever."""
    code = ("import os, signal, sys, threading, time\n"
            f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from test_engine import before_first_layer, grouped_net_and_batch\n"
            "from cgp.comm.local import LocalCommunicator\n"
            "from cgp.engine import Engine\n"
            "from cgp.runtime.procs import make_pool\n"
            "net, batch = grouped_net_and_batch()\n"
            "main = os.getpid()\n"
            "before_first_layer(net, lambda chunk: os.getpid() == main and time.sleep(60))\n"
            "pool = make_pool('processes', 2, [net])\n"
            "engine = Engine(net, 5, pool, LocalCommunicator(pool))\n"
            "pool.start()\n"
            "print(pool.procs[0].pid, flush=True)\n"
            "threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGKILL)).start()\n"
            "engine.run(batch, 2, 7)\n")
    main = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        worker = psutil.Process(int(main.stdout.readline()))
    finally:
        main.wait(timeout=60)   # killed 1.5 s into the run
        main.stdout.close()
    try:
        worker.wait(timeout=10)   # it checks every 0.5 ms of waiting whether its parent is there
    except psutil.TimeoutExpired:
        worker.kill()
        raise AssertionError("the orphaned worker kept waiting") from None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_loss_shares_add_in_chunk_order(dtype):
    """sum_rows (the engine's sum of the chunks' loss shares) adds the rows in order in the
    run's dtype: the same bits as a NumPy loop of total += row, on values whose sum another
    order rounds differently."""
    rng = np.random.default_rng(8)
    rows = (rng.standard_normal((16, 3)) * 10.0 ** rng.integers(-9, 9, (16, 3))).astype(dtype)
    want = np.zeros(3, dtype)
    for row in rows:
        want += row
    backwards = np.zeros(3, dtype)
    for row in rows[::-1]:
        backwards += row
    assert not np.array_equal(want, backwards)
    got = np.full(3, np.nan, dtype)
    sum_rows(rows, got)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("group, order", [(1, [(1, 2), (2, 3), (3, 4), (0, 1)]),
                                          (2, [(2, 4), (0, 2)]), (3, [(0, 3), (3, 4)])])
def test_calls_are_handed_out_largest_first(group, order):
    """Workers take calls in the order of engine.groups: those of most samples first (chunks
    of 2, 3, 3, 3 samples here), chunk order among equals, so that the calls left for the
    end are the small ones; every chunk in exactly one call."""
    net = Net(parse_net(GROUP_NET, "grouped.prototxt"), caffe_pb2.TRAIN, RunOptions())
    pool = Pool(1)
    engine = Engine(net, 4, pool, LocalCommunicator(pool), group=group)
    pool.close()
    assert [n for _, n in engine.bounds] == [2, 3, 3, 3]
    assert engine.groups == order


def test_engine_buffers_start_on_cache_lines():
    """Every buffer the engine and its workers allocate (blobs, layer scratch, chunk
    gradients, factors, the communicator's scratch) starts on a 64-byte boundary, so a
    kernel's speed does not change from one process to the next with where NumPy put it."""
    net = Net(parse_net(GROUP_NET, "grouped.prototxt"), caffe_pb2.TRAIN, RunOptions())
    net.init_params(5)
    rng = np.random.default_rng(4)
    batch = {net.sources[0].tops[0]: rng.standard_normal((11, 2, 9, 9)),
             net.sources[0].tops[1]: rng.integers(0, 5, 11).astype(np.float64)}
    pool = Pool(2)
    comm = LocalCommunicator(pool)
    engine = Engine(net, 5, pool, comm)
    engine.run(batch, 0, 1)
    pool.close()
    arrays = [engine.chunk_grads] + [a for f in engine.factored for a in (f.a, f.b)]
    arrays += [a for pair in comm._scratch.values() for a in pair]
    for ws in engine.workspaces:
        arrays += [a for a in ws.data + ws.diff if a is not None]
        for scratch in ws.scratch:
            for part in scratch if isinstance(scratch, list) else [scratch]:
                arrays += [a for a in part.values() if a.size]
    assert len(arrays) > 30 and len(engine.factored) == 1
    assert [a.ctypes.data % 64 for a in arrays] == [0] * len(arrays)


def test_a_batch_value_read_per_sample_keeps_one_chunk_per_call():
    """A per-sample layer reading a batch-value top (the loss's probabilities) would need it
    per chunk: such a net runs one chunk per call."""
    text = FACTOR_NET.replace('top: "loss" }', 'top: "loss" top: "prob" }') + (
        'layer { name: "flat" type: "Flatten" bottom: "prob" top: "flat" }\n')
    net = Net(parse_net(text, "probs.prototxt"), caffe_pb2.TRAIN, RunOptions())
    assert not net.groupable and group_size(net, 4, 1) == 1
    pool = Pool(1)
    assert len(Engine(net, 4, pool, LocalCommunicator(pool), group=4).groups) == 4


@njit
def _product(a, b):
    return a * b


@pytest.mark.skipif(not fpenv.SUPPORTED, reason="flushing subnormals needs an x86-64 CPU")
def test_flushing_subnormals_is_per_thread_and_restored():
    tiny, small = np.float32(1e-30), np.float32(1e-10)   # their product is subnormal
    outer = fpenv.set_flush(False)    # whatever this thread had, restored at the end
    assert _product(tiny, small) != 0 and not fpenv.flushing()
    state = fpenv.set_flush(True)
    assert fpenv.flushing() and _product(tiny, small) == 0
    fpenv.restore(state)
    assert not fpenv.flushing() and _product(tiny, small) != 0
    for threads in (1, 3):
        for flush in (True, False):
            pool = Pool(threads, flush_denormals=flush)
            seen = [None] * 6
            pool.run(lambda w, i: seen.__setitem__(i, fpenv.flushing()), 6)
            pool.run(lambda w, i: seen.__setitem__(i, seen[i] and fpenv.flushing()), 1)
            pool.close()
            assert seen == [flush] * 6, (threads, flush)
            assert not fpenv.flushing()   # the caller's own mode is left as it was
    fpenv.restore(outer)


@pytest.mark.skipif(not fpenv.SUPPORTED, reason="flushing subnormals needs an x86-64 CPU")
def test_subnormals_flushed_or_kept_alike_for_any_thread_count():
    """With inputs scaled into the subnormal range, flushing changes the gradient, and each
    mode gives the same bits on 1, 2 and 3 threads."""
    net = Net(parse_net(GROUP_NET, "grouped.prototxt"), caffe_pb2.TRAIN, RunOptions())
    net.init_params(5)
    rng = np.random.default_rng(4)
    batch = {net.sources[0].tops[0]: rng.standard_normal((11, 2, 9, 9)) * 3e-38,
             net.sources[0].tops[1]: rng.integers(0, 5, 11).astype(np.float64)}
    grads = {}
    for flush in (True, False):
        for threads in (1, 2, 3):
            pool = Pool(threads, flush_denormals=flush)
            engine = Engine(net, 5, pool, LocalCommunicator(pool), group=1 + threads % 2)
            grads[flush, threads] = engine.run(batch, 0, 7)[2].copy()
            pool.close()
    for flush in (True, False):
        assert all(np.array_equal(grads[flush, t], grads[flush, 1]) for t in (2, 3))
    assert not np.array_equal(grads[True, 1], grads[False, 1])


@pytest.fixture(scope="module")
def one_thread_runs():
    """(model, chunks) -> the 1-thread run, which both kinds of workers share: one worker
    runs in the caller, as plain sequential code (cgp.runtime.procs.forks)."""
    return {}


@pytest.mark.parametrize("workers", ["threads", "processes"])
@pytest.mark.parametrize("model,chunks", [("mnist", 16), ("mnist", 7), ("cifar10", 16)])
def test_bitwise_identical_for_any_thread_count(model, chunks, workers, mnist_dir, cifar_dir,
                                                one_thread_runs):
    data = mnist_dir if model == "mnist" else cifar_dir
    sp = solver(model, test_iter=[1])
    config = RunConfig(chunks=chunks, data_dir=str(data), workers=workers)
    assert THREADS[0] == 1 and not forks(workers, 1)
    if (model, chunks) not in one_thread_runs:
        one_thread_runs[model, chunks] = train_run(sp, None, replace(config, threads=1), 3)
    outcomes = [one_thread_runs[model, chunks]] + [
        train_run(sp, None, replace(config, threads=t), 3) for t in THREADS[1:]]
    rows, ok = compare(outcomes)
    assert ok, rows
    assert all(np.isfinite(o.losses).all() for o in outcomes)
    assert outcomes[0].losses[0] != outcomes[0].losses[-1]  # it trained


def test_chunk_count_changes_only_rounding(mnist_dir):
    sp = solver("mnist", test_iter=[1])   # the test's figures are not compared
    one = train_run(sp, None, RunConfig(chunks=1, data_dir=str(mnist_dir)), 2)
    many = train_run(sp, None, RunConfig(chunks=16, data_dir=str(mnist_dir)), 2)
    np.testing.assert_allclose(one.losses, many.losses, rtol=1e-5)
    np.testing.assert_allclose(one.params, many.params, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
def test_resume_from_snapshot_is_bitwise_identical(tmp_path, mnist_dir, threads):
    sp = solver("mnist", snapshot=3, test_interval=2, test_iter=[1], display=0,
                snapshot_prefix=str(tmp_path / f"t{threads}"))
    config = RunConfig(threads=threads, data_dir=str(mnist_dir), max_iter=6, workers="threads")
    whole = Trainer(sp, None, config, log=lambda line: None)
    whole.solve()
    resumed = Trainer(sp, None, config, log=lambda line: None)
    resumed.net.params[:] = 0  # must come back from the snapshot
    resumed.restore(tmp_path / f"t{threads}_iter_3.solverstate")
    assert resumed.iter == 3
    resumed.solve()
    assert np.array_equal(whole.net.params, resumed.net.params)
    assert np.array_equal(whole.solver.histories[0], resumed.solver.histories[0])
    assert whole.last_test == resumed.last_test


def test_equivalence_command_passes(mnist_dir, tmp_path):
    lenet = str(quick_solver(tmp_path))   # `mnist`, testing on one batch
    out = subprocess.run([sys.executable, "-m", "cgp", "equivalence", "--solver", lenet,
                          "--threads", ",".join(map(str, THREADS)), "--iters", "2", "--data-dir",
                          str(mnist_dir)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bitwise identical across thread counts: yes" in out.stdout
    assert "float32 engine vs float64 reference" in out.stdout and "ok" in out.stdout
    assert out.stdout.count("identical") >= len(THREADS)


def test_pool_runs_every_task_once_with_the_caller_as_worker_zero():
    import threading
    for threads in (1, 2, 3):
        pool = Pool(threads)
        ran, lock = [], threading.Lock()

        def task(w, i):
            with lock:
                ran.append((i, w, threading.get_ident()))

        pool.run(task, 40)
        pool.run(task, 0)   # nothing to run: returns at once
        assert sorted(i for i, _, _ in ran) == list(range(40))
        assert {w for _, w, _ in ran} <= set(range(threads))
        caller = threading.get_ident()
        assert all((ident == caller) == (w == 0) for _, w, ident in ran)
        # A task's exception reaches the caller once every started task has ended, and no
        # task starts after it.
        started = []

        def failing(w, i):
            started.append(i)
            if i == 3:
                raise ValueError("task 3")

        with pytest.raises(ValueError, match="task 3"):
            pool.run(failing, 200)
        assert 3 in started and len(started) < 200
        pool.run(task, 5)   # the pool still works
        assert len(ran) == 45
        pool.close()


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_the_callers_first_work_runs_after_its_first_task(workers):
    """run(..., first=f): the caller runs f once, after the first task it takes (so that a
    run of as many calls as workers starts every call at once), while the other worker
    takes tasks; f in the caller's own floating-point mode, the tasks with subnormals
    flushed; f's exception comes after every task. A caller that finds no task left runs f
    all the same."""
    from cgp.runtime.pool import CallersWork, _Run
    seen = aligned_zeros((40, 3), np.int64, shared=True)   # per task: done, worker, flushing

    def task(w, i):
        if w:   # the other worker slow, so that the caller surely gets a task of its own
            time.sleep(0.02)
        seen[i] = 1, w, fpenv.flushing()
    pool = make_pool(workers, 2)
    program = pool.program(task)
    pool.start()
    try:
        calls = []

        def first():
            done = seen[:, 0] == 1
            calls.append((int((done & (seen[:, 1] == 0)).sum()), fpenv.flushing()))
            deadline = time.monotonic() + 10
            while not ((seen[:, 0] == 1) & (seen[:, 1] == 1)).any():   # the other worker's
                assert time.monotonic() < deadline

        pool.run(program, 4, first=first)
        assert calls == [(1, False)] and (seen[:4, 0] == 1).all() and not seen[4:].any()
        assert (seen[:4, 2] == fpenv.SUPPORTED).all()   # every task flushed, first did not

        def failing():
            raise ValueError("first's own")
        seen[:] = 0
        with pytest.raises(ValueError, match="first's own"):
            pool.run(program, 40, first=failing)
        assert (seen[:, 0] == 1).all()
    finally:
        pool.close()
    ran = []
    run = _Run(lambda w, i: ran.append(i), 2, np.zeros(2, np.int64), ())
    run.next = 2   # the other workers took both
    state = fpenv.set_flush(True)   # as the pool does around its tasks
    try:
        run.work(0, CallersWork(lambda: ran.append("first"), state, True))
    finally:
        fpenv.restore(state)
    assert ran == ["first"]


@pytest.mark.parametrize("fused", [True, False])
def test_next_batch_is_read_during_the_run_before_and_only_once(fused, mnist_dir):
    """Trainer._work_ahead: iteration k reads iteration k + 1's batch during its own last
    pool run (whether the update runs in its reduction tasks or after them); every batch is
    read once, and one read ahead for a position the trainer then leaves (a jump back) is
    not used: the jump gives the bits of a fresh run."""
    sp = solver("mnist")
    runs = []
    for jump in (False, True):
        trainer = Trainer(sp, None, RunConfig(threads=2, data_dir=str(mnist_dir)),
                          log=lambda line: None)
        assert trainer.train_step.fused   # the bundled solver's update can be fused
        trainer.train_step.fused = fused
        layer = trainer.net.sources[0].layer
        reads, load = [], layer.load
        in_run = []

        def recording_load(position, iteration, seed, rows, load=load, reads=reads):
            reads.append((position, iteration, bool(in_run) and in_run[-1]))
            return load(position, iteration, seed, rows)
        layer.load = recording_load
        run = trainer.pool.run

        def marking_run(*args, **kw):
            in_run.append(kw.get("first") is not None)
            try:
                return run(*args, **kw)
            finally:
                in_run.clear()
        trainer.pool.run = marking_run
        for _ in range(3):
            trainer.step()
        if jump:   # back to iteration 0 from the start's weights, as bench speedup does
            trainer.iter = 0
            trainer.net.init_params(trainer.seed)
            for h in trainer.solver.histories:
                h[...] = 0
            for _ in range(3):
                trainer.step()
        runs.append(trainer.net.params.copy())
        trainer.close()
        if not jump:
            # Iteration 0's batch at the start; then 1, 2 and 3's, each during a run.
            assert [r[:2] for r in reads] == [(0, 0), (64, 1), (128, 2), (192, 3)]
            assert [r[2] for r in reads] == [False, True, True, True]
        else:
            assert [r[:2] for r in reads][3:6] == [(192, 3), (0, 0), (64, 1)]
    assert np.array_equal(runs[0], runs[1])


@pytest.mark.parametrize("threads", [1, 3])
def test_training_through_the_reference_communicator_gives_the_same_bits(threads):
    """The data-parallel step over the naive NumPy communicator (the whole gradient in one
    task, from materialised chunk gradients) and over the
    local one (factored weights, the update in the reduction's tasks): the same weights,
    losses and solver history, step after step."""
    net, batch = grouped_net_and_batch()
    sp = solver("mnist", type="Adam", weight_decay=0.01)
    results = []
    for comm in (ReferenceCommunicator, LocalCommunicator):
        net.init_params(5)
        pool = Pool(threads)
        engine = Engine(net, 5, pool, comm(pool))
        assert bool(engine.factored) == (comm is LocalCommunicator)
        step = DataParallelStep(engine, Solver(sp, net.lr_mult, net.decay_mult), engine.comm)
        assert step.fused
        losses = [step(it, lambda k: (batch, it), 7)[0] for it in range(4)]
        results.append((losses, net.params.copy(), step.solver.histories[1].copy()))
        pool.close()
    assert results[0][0] == results[1][0] and results[0][0][0] != results[0][0][-1]
    assert np.array_equal(results[0][1], results[1][1])
    assert np.array_equal(results[0][2], results[1][2])


def test_spin_waits_see_another_threads_write():
    """The watched value is read from memory on every pass (an atomic load), not once: a
    write from another thread ends the wait long before the reads run out."""
    import threading
    from cgp.runtime import spin
    flags = np.zeros(2, np.int64)
    flags[1] = 7
    assert spin.wait_while(flags, 1, 5, 10) == 7    # not the value: at once
    assert spin.wait_while(flags, 1, 7, 10) == 7    # still the value after 10 reads
    assert spin.wait_for(flags, 1, 7, 0) == 7 and spin.wait_for(flags, 1, 9, 10) == 7
    # Every counter of a range: the first below the target ends the wait once reads run out.
    many = np.array([3, 5, 2, 9], np.int64)
    assert spin.wait_for_all(many, 0, 2, 3, 0) == 3 and spin.wait_for_all(many, 1, 4, 2, 0) == 2
    assert spin.wait_for_all(many, 0, 4, 3, 10) == 2 and spin.wait_for_all(many, 2, 2, 7, 0) == 7
    seen = []
    watcher = threading.Thread(target=lambda: seen.append(
        spin.wait_while(flags, 0, 0, 1 << 62)))     # years of reads, if it never saw it
    watcher.start()
    flags[0] = 3
    watcher.join(timeout=30)
    assert seen == [3]


def _cpu_ns(thread):
    """CPU time a thread has run (Linux's schedstat), in nanoseconds."""
    with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
        return int(f.read().split()[0])


def test_pool_threads_spin_between_runs_and_rest_on_request():
    """A pool thread keeps its CPU for a while after a run (runtime.spin), and gives it up
    at once after rest(). Hundreds of runs in a row lose no wake-up."""
    import os
    import time
    if not os.path.exists("/proc/self/task") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs Linux's per-thread CPU times and two CPUs")

    def spent_while_caller_works(pool, rest):
        """The pool thread's CPU time while the caller computes for 30 ms after a run."""
        pool.run(lambda w, i: None, 2)
        if rest:
            pool.rest()
        before = _cpu_ns(pool._workers[0])
        started = time.perf_counter()
        while time.perf_counter() - started < 0.03:
            pass
        return _cpu_ns(pool._workers[0]) - before

    pool = Pool(2)
    done = []
    for r in range(300):
        pool.run(lambda w, i: done.append(i), 3)
        if r % 50 == 0:
            pool.rest()
    assert sorted(done) == sorted(list(range(3)) * 300)
    # Five tries: on a shared VM a thread's CPU time also counts moments the host took
    # from it, and a busy neighbour can keep a spinning thread off its core for a whole
    # try, so a small figure is its least and a large one its most (a pool that spun when
    # it should sleep would spin in every try).
    tries = [[spent_while_caller_works(pool, rest) for rest in (False, True)]
             for _ in range(5)]
    pool.close()
    assert not pool._workers
    assert min(rest for _, rest in tries) < 5e6, tries
    assert max(spun for spun, _ in tries) > 5e6, tries   # up to SPIN_SECONDS, 10 ms


def test_affinity_pins_workers_and_changes_nothing(mnist_dir):
    import os
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no thread affinity on this OS")
    sp = solver("mnist", test_iter=[1])   # the test's figures are not compared
    plain = train_run(sp, None, RunConfig(threads=2, workers="threads",
                                          data_dir=str(mnist_dir)), 2)
    for workers in ("threads", "processes"):
        pinned = train_run(sp, None, RunConfig(threads=2, affinity=True, workers=workers,
                                               data_dir=str(mnist_dir)), 2)
        assert pinned.sha256 == plain.sha256 and pinned.losses == plain.losses
    import threading
    allowed = os.sched_getaffinity(0)
    pool = Pool(2, affinity=True)
    both = threading.Barrier(2)  # holds task 0 until a second worker has started
    cpus = [None] * 4
    pool.run(lambda w, i: (cpus.__setitem__(i, os.sched_getaffinity(0)),
                           both.wait(timeout=10) if i < 2 else None), 4)
    # The caller (worker 0) and the pool thread each on a CPU of their own.
    assert len(pool.pinned) == 2 and set(pool.pinned) <= allowed
    assert sorted(map(len, cpus[:2])) == [1, 1] and (cpus[0] != cpus[1] or len(allowed) == 1)
    pool.close()
    assert os.sched_getaffinity(0) == allowed   # the caller's pin ends with the pool


def test_memory_is_reported_and_refused_before_running_out(mnist_dir):
    from cgp.errors import CgpError
    from cgp.train import check_memory
    trainer = Trainer(solver("mnist"), None, RunConfig(data_dir=str(mnist_dir)), log=lambda l: None)
    net = trainer.net
    trainer.close()
    line = check_memory(net, 16, 2, 1, available=2**34)
    # ip1 and ip2's weights (500 x 800, 10 x 500) are factored: 64 rows of 500 + 800 and
    # 10 + 500 values each instead of a copy per chunk.
    dense = 431080 - 500 * 800 - 10 * 500
    assert f"16 chunks x {dense} parameters + factors of 2 weights" in line
    mib = (16 * dense + 64 * (1300 + 510)) * 4 / 2**20
    assert f"({mib:.1f} MiB)" in line
    # The bound grows with chunks, not with the batch size.
    assert check_memory(net, 4, 2, 1, 2**34) != line
    with pytest.raises(CgpError, match="not enough memory.*--chunks"):
        check_memory(net, 16, 2, 1, available=5 * 2**20)
