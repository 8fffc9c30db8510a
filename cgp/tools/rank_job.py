"""One rank of a training that `cgp bench speedup --ranks` times: mpirun starts R of these;
rank 0 reads one operation per line from its standard input (which mpirun forwards to it),
every rank runs it, and rank 0 answers with one line of JSON, marked with REPLY (defined in
cgp.tools.speedup, which starts the job). The
operations are those of a timed configuration (cgp.tools.speedup.cgp_config): run N
iterations, save, restore, digest, pause, and `clock`, the communicator's timing."""
import json
import sys

from cgp.tools.speedup import REPLY, cgp_config


def main(spec_path):
    from cgp.prototxt import read_solver
    from cgp.train import RunConfig, Trainer

    with open(spec_path) as f:
        spec = json.load(f)
    config = RunConfig(**spec["config"])
    trainer = Trainer(read_solver(spec["solver"]), spec["solver"], config,
                      log=lambda line: None)
    timed = cgp_config(config.threads, trainer, config.workers)
    world = trainer.comm.comm
    leader = world.Get_rank() == 0
    try:
        with timed.context():
            while True:
                line = sys.stdin.readline() if leader else None
                # Not world.bcast: MPI's blocking call would spin while rank 0 waits for
                # its input, beside the exchange thread's calls (cgp.comm.mpi).
                op, args = json.loads(trainer.comm.broadcast(line or '["end", []]'))
                if op == "end":
                    break
                if op == "clock":
                    answer = dict(trainer.comm.clock)
                    answer["bytes"] = trainer.comm.bytes_per_step()
                else:
                    answer = getattr(timed, op)(*args)
                if leader:
                    print(REPLY + json.dumps(answer), flush=True)
    finally:
        trainer.close()


if __name__ == "__main__":
    from cgp.comm import mpi
    try:
        main(sys.argv[1])
    except BaseException as error:   # noqa: BLE001  (any failure ends every rank of the job)
        mpi.abort(mpi.world(), 1, f"{type(error).__name__}: {error}")
