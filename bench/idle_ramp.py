"""How a CPU of this machine regains its speed after idling: a trainer's workers rest (as
`cgp bench speedup` rests them between timings), every CPU idles for a while, and then the
next steps are timed one by one. Prints the median time of each step after each idle time,
over --rounds rounds. Steps that start slow and speed up over several steps after idling,
not after 1 ms, mean that timings which start on idle CPUs (interleaved configurations)
count a ramp that training, its CPUs never idle, does not pay: `cgp bench speedup
--lead-in` leaves those steps untimed.

    python bench/idle_ramp.py [mnist|cifar10] [--threads 2] [--workers processes]
                              [--idle 0,0.001,0.005,0.02,0.1] [--steps 10] [--rounds 15]
                              [--data-dir DIR]
"""
import argparse
import statistics
import time

from threadpoolctl import threadpool_limits

from cgp import models
from cgp.prototxt import read_solver
from cgp.train import RunConfig, Trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="mnist")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workers", default="processes", choices=("threads", "processes"))
    parser.add_argument("--idle", default="0,0.001,0.005,0.02,0.1",
                        help="comma-separated idle times in seconds")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    path = models.solver_path(args.model)
    trainer = Trainer(read_solver(path), path,
                      RunConfig(threads=args.threads, progress=False, data_dir=args.data_dir,
                                workers=args.workers), log=lambda line: None)
    print(f"{args.model}, {args.threads} worker(s) as {args.workers}: ms per step, the "
          f"median of {args.rounds} rounds, for steps 1 - {args.steps} after idling")
    try:
        with threadpool_limits(limits=1):
            for _ in range(5):
                trainer.step()
            for idle in (float(s) for s in args.idle.split(",")):
                steps = [[] for _ in range(args.steps)]
                for _ in range(args.rounds):
                    trainer.pool.rest()
                    time.sleep(idle)
                    for times in steps:
                        started = time.perf_counter()
                        trainer.step()
                        times.append(time.perf_counter() - started)
                print(f"  idle {1e3 * idle:5.0f} ms: " +
                      " ".join(f"{1e3 * statistics.median(t):.2f}" for t in steps))
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
