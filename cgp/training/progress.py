"""Caffe's display during training: every `display` iterations the smoothed loss (with
cgp's speed), the train net's outputs and the learning rate; the closing loss line; and a
progress bar (tqdm, optional) while stderr is a terminal, which the log lines then print
past. It reads the trainer's count, clock and log, and changes only the window of losses it
smooths."""
import sys


def fmt(value):
    return f"{value:.6g}"


def loss_note(net, name, value):
    """Caffe's " (* w = w*value loss)" after an output that is a loss of weight w."""
    weight = next((w for b, w in net.loss_weights.items() if net.blob_names[b] == name), 0)
    return f" (* {fmt(weight)} = {fmt(weight * value)} loss)" if weight else ""


def smoothed(losses, loss, average_loss):
    """Caffe's smoothed loss: loss added to the window `losses` (a snapshot keeps it), of
    the latest average_loss losses (at least one), and their mean."""
    losses.append(loss)
    del losses[:-max(1, average_loss)]
    return sum(losses) / len(losses)


class Progress:
    """The display of a trainer's solve(): entered for the run (the bar, the clock of the
    speed), after_step() after each iteration, closing() after the last."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.bar = None
        self.log = None           # the trainer's log while the bar prints past it
        self.last = self.last_iter = None   # the clock and the count at the latest display

    def __enter__(self):
        t = self.trainer
        try:
            from tqdm import tqdm
        except ImportError:  # optional: no bar
            tqdm = None
        if t.config.progress and sys.stderr.isatty() and tqdm is not None:
            self.bar = tqdm(total=t.max_iter, initial=t.iter, unit="it", dynamic_ncols=True,
                            leave=False)
            self.log, t.log = t.log, self.write
        self.last, self.last_iter = t.clock(), t.iter
        return self

    def write(self, line):
        """The trainer's log while the bar shows: printed past the bar."""
        if self.log is print:
            self.bar.write(line)
        else:
            self.log(line)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
            self.trainer.log, self.bar = self.log, None

    def after_step(self, it, loss, outputs, rate):
        """After iteration `it` (the count before the step; the trainer's is after it)."""
        t, display = self.trainer, self.trainer.sp.display
        smooth = smoothed(t.losses, loss, t.sp.average_loss)
        if self.bar is not None:
            self.bar.update(t.iter - it)
        # A multiple of display passed: it itself, where the count grows by one.
        if display and (t.iter - 1) // display > (it - 1) // display:
            now = t.clock()
            speed = max(1, t.iter - self.last_iter) / max(now - self.last, 1e-9)
            t.log(f"Iteration {it} ({speed:.3g} iter/s, "
                  f"{speed * t.net.batch_size * t.sp.iter_size:.0f} img/s), "
                  f"loss = {fmt(smooth)}")
            for j, (name, value) in enumerate(outputs.items()):
                t.log(f"    Train net output #{j}: {name} = {fmt(value)}"
                      f"{loss_note(t.net, name, value)}")
            t.log(f"Iteration {it}, lr = {fmt(rate)}")
            self.last, self.last_iter = now, t.iter

    def closing(self, loss):
        """Caffe's last display: the loss of the final weights on the next batch."""
        t = self.trainer
        t.log(f"Iteration {t.iter}, loss = {fmt(smoothed(t.losses, loss, t.sp.average_loss))}")
