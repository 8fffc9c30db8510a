"""When a periodic unit of the trainer (a test, a snapshot) is due: the iteration count
against an interval. Where groups of ranks share weights asynchronously (cgp.comm.sharing)
the count grows by more than one a step, so a multiple may be passed rather than hit."""
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Count:
    """Where a training stands: the iteration count `it`; `start`, the count where the
    latest steps() began; `drained`: every iteration to max_iter is claimed."""
    it: int
    start: int = 0
    drained: bool = False

    def reached(self, interval):
        """Whether the count is at a multiple of interval (> 0), or, where it grows by more
        than one a step, has passed one since the latest steps() began (until every
        iteration is claimed: the final count is then taken as it is)."""
        if interval <= 0:
            return False
        return self.it % interval == 0 or (not self.drained
                                           and self.it // interval > self.start // interval)


def until(it, interval):
    """Iterations from `it` to the next multiple of interval (> 0; else never: infinity):
    how far one steps() call may run before the unit with this interval is due."""
    return interval - it % interval if interval > 0 else math.inf
