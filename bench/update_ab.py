"""Interleaved A/B of whole training steps with the solver's update kernels of another git
revision, which read per-element lr_mult and decay_mult arrays (as before the kernels took
each slice's multipliers as scalars), against the working tree's. Two trainers train from
one seed in one process, their steps interleaved round by round; they must end with bitwise
equal weights. Also times the update kernels alone over the net's parameters, both ways.

    python bench/update_ab.py [mnist|cifar10] [--base 8c8dd84] [--threads 1] [--rounds 15]
                              [--steps 8] [--data-dir DIR]
"""
import argparse
import statistics
import tempfile
import time

# bench/, on the path
from interleave import ab_pair, add_pair_options, import_revision, pair_trainer


def old_apply(solver, base):
    """Solver.apply as of the base revision: one kernel call per slice, over the multiplier
    arrays."""
    kernel = getattr(base, solver._kernel.__name__)

    def apply(step, params, grads, lo, hi):
        extra = (step.correction,) if solver.type == "Adam" else ()
        kernel(params, grads, *solver.histories, solver.lr_mult, solver.decay_mult, lo, hi,
               step.rate, step.clip_scale, solver._accum, solver._weight_decay, solver._l1,
               *solver._hyper, *extra)
    return apply


def kernel_times(trainer, apply, rounds=200):
    """Median ms of one update over every slice, with apply, on the trainer's arrays (their
    values change, which costs the kernels nothing)."""
    step = trainer.solver.prepare(trainer.iter, trainer.engine.chunk_grads[0], trainer.slices)
    params, grads = trainer.net.params.copy(), trainer.engine.chunk_grads[0].copy()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for lo, hi in trainer.slices:
            apply(step, params, grads, lo, hi)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, threads=1)
    parser.add_argument("--base", default="8c8dd84")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        base = import_revision(args.base, "cgp/runtime/update.py", folder, "update_ab.py")
        pair = [pair_trainer(args, "threads") for _ in range(2)]
        pair[0].solver.apply = old_apply(pair[0].solver, base)
        for _ in range(2):   # compiled first
            pair[0].step(), pair[1].step()
        for name, t in zip((args.base, "working tree"), pair):
            print(f"update alone, {name}: {kernel_times(t, t.solver.apply):.3f} ms")
        ab_pair(pair, (args.base, "working tree"), args)


if __name__ == "__main__":
    main()
