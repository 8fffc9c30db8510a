"""Caffe's test passes during training: each test net, on the train net's weights, runs
test_iter batches every test_interval iterations (at iteration 0 too with
test_initialization), its outputs averaged and logged as Caffe logs them. Signals are
acted on between test batches, as in Caffe; a stop ends the test."""
import functools

from cgp.errors import CgpError
from cgp.training.progress import fmt, loss_note
from cgp.training.triggers import until


def copy_shared(train, test):
    """Test nets use the train net's weights, matched by layer name as Caffe's
    ShareTrainedLayersWith does."""
    for blob in test.param_blobs:
        for source in train.blob_param(blob.layer)[blob.index:blob.index + 1]:
            if source.shape != blob.shape:
                raise CgpError(f"layer '{blob.layer}' blob {blob.index}: shape {blob.shape} in "
                               f"the test net, {source.shape} in the train net")
            test.params[blob.offset:blob.offset + blob.size] = \
                train.params[source.offset:source.offset + source.size]


class PeriodicTests:
    """The periodic tests of a trainer's test nets (none: never due)."""

    def __init__(self, sp, test_nets, test_engines):
        self.sp, self.nets, self.engines = sp, test_nets, test_engines
        self.interval = sp.test_interval if test_nets else 0

    def due(self, count):
        """At a test_interval boundary (triggers.Count), at iteration 0 only with
        test_initialization."""
        return count.reached(self.interval) and (count.it > 0 or self.sp.test_initialization)

    def until(self, it):
        return until(it, self.interval)

    def before(self, it, data_origin):
        """How many test passes Caffe runs from the data origin up to iteration `it`: the
        test data reader goes on from where the previous pass stopped."""
        interval = self.interval
        if interval <= 0:
            return 0

        def points(end):  # iterations 0, interval, 2 * interval, ... < end
            return (end - 1) // interval + 1 if end > 0 else 0
        done = points(it) - points(data_origin)
        if data_origin == 0 and not self.sp.test_initialization:
            done -= min(done, 1)   # no test at iteration 0
        return done

    def run_one(self, trainer, index):
        """One test pass of test net `index` (Trainer.test): (outputs averaged over test_iter
        batches, the loss likewise), or None when a signal asked to stop meanwhile: the
        requests are acted on between batches (a snapshot at once)."""
        net, engine = self.nets[index], self.engines[index]
        copy_shared(trainer.net, net)
        iters = self.sp.test_iter[index]
        first = self.before(trainer.iter, trainer.data_origin) * iters
        sums, loss = {}, 0.0
        for k in range(iters):
            trainer.act_on_request()
            if trainer.stopped:
                return None
            batch = trainer._batch(engine, (first + k) * net.batch_size, first + k)
            # The next batch is read during this one's run (Trainer.read_ahead), where the
            # caller's read would otherwise keep every worker waiting.
            after = first + k + 1
            ahead = (None if k + 1 == iters else
                     functools.partial(trainer.read_ahead, engine, after * net.batch_size, after))
            outputs, batch_loss, _ = engine.run(batch, first + k, trainer.seed, first=ahead)
            if trainer.heartbeat is not None:   # a long test is progress too (cgp launch)
                trainer.heartbeat.beat(trainer.iter)
            loss += batch_loss
            for name, value in outputs.items():
                sums[name] = sums.get(name, 0.0) + value
        return {name: value / iters for name, value in sums.items()}, loss / iters

    def run(self, trainer):
        """Every test net, logged; trainer.last_test and last_test_iter take the results
        (those of the last net), unless a stop interrupts."""
        if not trainer.comm.leader_group:   # cgp.comm.sharing: rank 0's group tests
            return
        for i, net in enumerate(self.nets):
            trainer.log(f"Iteration {trainer.iter}, Testing net (#{i})")
            result = self.run_one(trainer, i)
            if result is None:
                trainer.log("Test interrupted.")
                return
            trainer.last_test, loss = result
            trainer.last_test_iter = trainer.iter
            if self.sp.test_compute_loss:
                trainer.log(f"Test loss: {fmt(loss)}")
            for j, (name, value) in enumerate(trainer.last_test.items()):
                trainer.log(f"    Test net output #{j}: {name} = {fmt(value)}"
                            f"{loss_note(net, name, value)}")
