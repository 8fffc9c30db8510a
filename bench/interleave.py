"""Timing helper shared by the bench scripts that compare trainers in one process."""
import time

from threadpoolctl import threadpool_limits


def interleaved_rounds(trainers, rounds, steps, warmup=3):
    """Times `steps` training steps of each trainer in turn, `rounds` times over, after
    `warmup` untimed steps each, so that a change of the machine's speed hits them all alike.
    Returns one list of round times (seconds) per trainer."""
    times = [[] for _ in trainers]
    with threadpool_limits(limits=1):
        for t in trainers:
            for _ in range(warmup):
                t.step()
        for _ in range(rounds):
            for t, row in zip(trainers, times):
                started = time.perf_counter()
                for _ in range(steps):
                    t.step()
                row.append(time.perf_counter() - started)
    return times
