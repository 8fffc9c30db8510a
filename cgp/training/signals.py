"""Caffe's signal effects during training: SIGINT (Ctrl-C), SIGHUP and SIGTERM each ask
for a stop, a snapshot or nothing (--sigint-effect, ...). A handler only records the
request; the trainer acts on it after the current iteration, at the same iteration on every
process (agree). This module writes no snapshot and stops nothing itself."""
import signal

from cgp.errors import CgpError

SIGNAL_EFFECTS = ("stop", "snapshot", "none")
REQUESTS = (None, "snapshot", "stop")   # what a signal asks of training, weakest first


def check_effects(*effects):
    for effect in effects:
        if effect not in SIGNAL_EFFECTS:
            raise CgpError(f"signal effect '{effect}': expected one of "
                           f"{', '.join(SIGNAL_EFFECTS)}")


class Signals:
    """The requests that signals make of a training, and their handlers, installed while
    the training (or its final test) runs: `with signals:`. SIGINT (Ctrl-C) 'stop' by
    default: stop, and snapshot as at the end of training (when snapshot_after_train is on,
    Caffe's default); SIGHUP 'snapshot' by default: snapshot and go on; SIGTERM, which batch
    schedulers (Slurm, PBS) send some time before they kill a job, as SIGINT. A second
    Ctrl-C or SIGTERM while stopping interrupts at once."""

    def __init__(self, sigint_effect, sighup_effect, sigterm_effect):
        self.effects = {signal.SIGINT: sigint_effect, signal.SIGTERM: sigterm_effect}
        if hasattr(signal, "SIGHUP"):
            self.effects[signal.SIGHUP] = sighup_effect
        self.request = None        # what a signal asked for: "stop" or "snapshot"
        self.told_to_stop = False  # a signal asked this process to stop
        self.heard = []            # what the handler has to say (agree says it)
        self.old = {}              # the handlers this one replaced while installed

    def __enter__(self):
        self.old = {}
        try:
            for signum in self.effects:
                self.old[signum] = signal.signal(signum, self.handle)
        except ValueError:  # not the main thread: leave signals alone
            pass
        return self

    def __exit__(self, *exc):
        for signum, old in self.old.items():
            signal.signal(signum, old)

    def handle(self, signum, frame):
        effect = self.effects[signum]
        if effect == "none":
            return
        if (signum in (signal.SIGINT, signal.SIGTERM) and effect == "stop"
                and self.told_to_stop):
            raise KeyboardInterrupt
        # This process's own stop (another rank's reaches it through agree).
        self.told_to_stop |= effect == "stop"
        self.request = max(self.request, effect, key=REQUESTS.index)
        # Said at the next iteration's end (agree): the handler may interrupt the log in
        # the middle of a line, which a write here would corrupt.
        name = signal.Signals(signum).name
        again = "Ctrl-C" if signum == signal.SIGINT else name
        self.heard.append(
            f"{name}: {'stopping' if effect == 'stop' else 'snapshotting'} after "
            "this iteration" + (f" ({again} again to abort)" if effect == "stop" else ""))

    def agree(self, schedule, log):
        """The request that every process acts on now, kept as this one's: the strongest any
        of them has (under MPI a signal may reach one rank only, or the ranks at different
        iterations), so that all stop, or snapshot, at the same iteration. Says first what
        the handler heard. A collective call (schedule: cgp.comm.make_schedule's): every
        process makes it as often."""
        while self.heard:
            log(self.heard.pop(0))
        self.request = REQUESTS[schedule.request(REQUESTS.index(self.request))]
        return self.request
