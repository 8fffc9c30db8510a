"""Large-batch rules on one solver: writes variants of it whose training batch is k times
larger, with linear scaling alone (base_lr x k, max_iter / k and every iteration count of the
schedule with it, so each variant sees the same epochs) or with more rules (Intel Caffe's
warm-up, its LARS), runs `cgp train` on each, one after another, and prints a table of the
final test accuracy, test loss and wall time. The variants' prototxts and logs
stay in --out, with the command that reruns each one by hand (OUT/results.md).

    python bench/large_batch.py lenet --factors 1,8,32 --rules linear,warmup+lars --out DIR
                                [--max-iter N] [--threads 2] [--data-dir DIR] [--write-only]

The example batch (factor 1) runs as the solver has it; the rules apply to the larger ones.
warmup: the rate ramps from the example batch's rate to the variant's over the first
--warmup share of its iterations (warmup_iter, warmup_start_lr), as Goyal et al. ramp it.
lars: local_lr_auto with local_gw_ratio --lars-ratio (Intel Caffe's default, 0.001); LARS
replaces each blob's lr_mult by ratio |w| / (|g| + weight_decay |w|), so the global rate is
of another order: --lars-lr at the example batch (default 100 x base_lr), x k as the rest.
A variant that diverges is a result: its row says at which iteration.
"""
import argparse
import csv
import math
import subprocess
import sys
import time
from pathlib import Path

from cgp import models
from cgp.net import layer_included
from cgp.proto import caffe_pb2
from cgp.prototxt import format_message, format_solver, read_net, read_solver, solver_extras
from cgp.train import resolve

RULES = ("linear", "warmup", "lars", "warmup+lars")
# The schedule's fields that count iterations: divided by k (at least 1).
ITERATION_FIELDS = ("test_interval", "display", "stepsize")


def solver_of(name):
    """The solver file of a bundled model's short name, or the path given."""
    return Path(name) if name.endswith(".prototxt") else models.solver_path(name)


def train_phase(lp):
    state = caffe_pb2.NetState(phase=caffe_pb2.TRAIN)
    return layer_included(lp, state)


def scaled_net(net, k, where):
    """A copy of net with its TRAIN-phase Data layers' batch_size x k."""
    net = caffe_pb2.NetParameter.FromString(net.SerializeToString())
    found = False
    for lp in net.layer:
        if not train_phase(lp):
            continue
        if lp.type == "Data":
            lp.data_param.batch_size *= k
            found = True
        elif lp.type.endswith("Data") or lp.type == "Input":
            sys.exit(f"large_batch.py: {where}: layer '{lp.name}' ({lp.type}): only Data "
                     "layers' batch_size is scaled here")
    if not found:
        sys.exit(f"large_batch.py: {where}: no Data layer in the TRAIN phase to scale")
    return net


def scaled_solver(sp, k, rule, args):
    """A copy of the solver (caffe_pb2.SolverParameter, the forks' fields kept) for batch
    x k under `rule` (RULES), its net to be named by the caller."""
    sp = caffe_pb2.SolverParameter.FromString(sp.SerializeToString())
    extras = solver_extras(sp)
    extras.DiscardUnknownFields()   # caffe's fields, which it holds as unknown ones
    sp.DiscardUnknownFields()       # the forks' fields, written back below
    if args.max_iter:
        sp.max_iter = args.max_iter
    lars = rule in ("lars", "warmup+lars")
    base_lr = (args.lars_lr or 100 * sp.base_lr) if lars else sp.base_lr
    sp.base_lr = base_lr * k
    sp.max_iter = math.ceil(sp.max_iter / k)
    for name in ITERATION_FIELDS:
        if getattr(sp, name):
            setattr(sp, name, max(1, round(getattr(sp, name) / k)))
    sp.stepvalue[:] = [max(1, round(v / k)) for v in sp.stepvalue]
    # The rate at iteration i / k of a variant is the example's at i: inv and sigmoid take
    # gamma x iteration, exp gamma ^ iteration (step, multistep: the counts above; poly
    # reads max_iter).
    if sp.lr_policy in ("inv", "sigmoid"):
        sp.gamma *= k
    elif sp.lr_policy == "exp":
        sp.gamma **= k
    sp.snapshot = 0   # only the final weights (Caffe's snapshot_after_train)
    if rule in ("warmup", "warmup+lars"):
        extras.warmup_iter = max(1, round(args.warmup * sp.max_iter))
        extras.warmup_start_lr = base_lr
    if lars:
        extras.local_lr_auto = True
        extras.local_gw_ratio = args.lars_ratio
    sp.MergeFromString(extras.SerializeToString())
    return sp


def variants(args):
    """[(name, k, rule), ...]: the example batch once, then every factor's rules."""
    stem = Path(args.model).stem.replace("_solver", "")
    out = []
    for k in args.factors:
        for rule in (["linear"] if k == 1 else args.rules):
            out.append((f"{stem}_x{k}" + ("" if k == 1 else f"_{rule.replace('+', '_')}"),
                        k, rule))
    return out


def write_variants(args):
    """Writes each variant's solver and net into --out; returns [(name, batch, solver,
    command), ...]: the variant's training batch, its SolverParameter and the command line
    that runs it."""
    path = solver_of(args.model)
    sp = read_solver(path)
    if not sp.HasField("net"):
        sys.exit(f"large_batch.py: {path}: the solver must name its net in `net`")
    net_path = resolve(sp.net, path.parent, "net")
    net = read_net(net_path)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, k, rule in variants(args):
        variant = scaled_solver(sp, k, rule, args)
        variant.net = f"{name}_train_test.prototxt"   # found beside the solver
        variant.ClearField("snapshot_prefix")
        head = (f"# {path.name}, batch x{k}, {rule}: written by bench/large_batch.py\n")
        (out / f"{name}_solver.prototxt").write_text(head + format_solver(variant))
        scaled = scaled_net(net, k, net_path)
        (out / variant.net).write_text(head + format_message(scaled))
        batch = next(lp.data_param.batch_size for lp in scaled.layer
                     if train_phase(lp) and lp.type == "Data")
        command = ["python", "-m", "cgp", "train", "--solver",
                   str(out / f"{name}_solver.prototxt"), "--threads", str(args.threads),
                   "--snapshot-prefix", str(out / name), "--log", str(out / f"{name}.log")]
        if args.data_dir:
            command += ["--data-dir", str(Path(args.data_dir).resolve())]
        written.append((name, batch, variant, command))
    return written


def last_values(csv_path):
    """{(phase, name): (iteration, value)} of the last row of each value in a training's CSV."""
    values = {}
    if csv_path.exists():
        with open(csv_path) as f:
            for row in csv.DictReader(f):
                values[(row["phase"], row["name"])] = (int(row["iteration"]), float(row["value"]))
    return values


def run_variant(name, batch, variant, command, out):
    """Runs one variant; returns its row of the table."""
    log = out / f"{name}.log"
    for old in (log, log.with_suffix(".csv")):
        old.unlink(missing_ok=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True)
    wall = time.perf_counter() - started
    (out / f"{name}.out").write_text(done.stdout + done.stderr)
    values = last_values(log.with_suffix(".csv"))
    extras = solver_extras(variant)
    row = {"variant": name, "batch": batch, "base_lr": variant.base_lr,
           "max_iter": variant.max_iter, "warmup_iter": extras.warmup_iter,
           "lars": extras.local_lr_auto, "wall_s": wall, "status": "done",
           "accuracy": None, "test_loss": None}
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("cgp: error")]
        row["status"] = errors[-1] if errors else f"exit status {done.returncode}"
    for (phase, key), (it, value) in values.items():
        if phase == "test0" and key in ("accuracy", "loss") and it == variant.max_iter:
            row["accuracy" if key == "accuracy" else "test_loss"] = value
    return row


def table(rows):
    """The results as a Markdown table."""
    def num(value, fmt):
        return "—" if value is None else format(value, fmt)
    lines = ["| variant | batch | base_lr | max_iter | warm-up | LARS | test accuracy | "
             "test loss | wall s | status |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['batch']} | {r['base_lr']:g} | {r['max_iter']} | "
                     f"{r['warmup_iter'] or '—'} | {'yes' if r['lars'] else '—'} | "
                     f"{num(r['accuracy'], '.4f')} | {num(r['test_loss'], '.4f')} | "
                     f"{r['wall_s']:.0f} | {r['status']} |")
    return "\n".join(lines)


def parse_args(argv=None):
    """The options of the command line (argv: sys.argv's); exits with a usage message on a
    wrong one."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a bundled model's short name (lenet, cifar10_quick, ...) "
                        "or a solver prototxt whose net has Data layers")
    parser.add_argument("--out", required=True, help="folder for the variants and their logs")
    parser.add_argument("--factors", default="1,8,32",
                        help="batch multipliers, comma-separated (default 1,8,32)")
    parser.add_argument("--rules", default="linear,warmup+lars",
                        help=f"rules for the factors above 1, comma-separated, from "
                             f"{', '.join(RULES)}; each includes linear scaling "
                             "(default linear,warmup+lars)")
    parser.add_argument("--max-iter", type=int, default=None,
                        help="the example batch's max_iter (default the solver's), scaled "
                             "as the rest: a shorter schedule")
    parser.add_argument("--warmup", type=float, default=0.05,
                        help="warm-up's share of each variant's iterations (default 0.05)")
    parser.add_argument("--lars-ratio", type=float, default=0.001,
                        help="LARS's local_gw_ratio (default 0.001, Intel Caffe's)")
    parser.add_argument("--lars-lr", type=float, default=None,
                        help="LARS variants' base_lr at the example batch, x k as the rest "
                             "(default 100 x the solver's base_lr)")
    parser.add_argument("--threads", type=int, default=2, help="cgp train's --threads")
    parser.add_argument("--data-dir", default=None, help="cgp train's --data-dir")
    parser.add_argument("--only", default=None,
                        help="run only these variants (names, comma-separated)")
    parser.add_argument("--write-only", action="store_true",
                        help="write the variants and their commands; run nothing")
    args = parser.parse_args(argv)
    try:
        args.factors = [int(f) for f in args.factors.split(",")]
    except ValueError:
        parser.error(f"--factors wants whole numbers, comma-separated; got {args.factors!r}")
    args.rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    if min(args.factors) < 1 or not args.rules or not set(args.rules) <= set(RULES):
        parser.error(f"--factors must be at least 1 and --rules among {', '.join(RULES)}")
    if not 0 < args.warmup < 1 or args.lars_ratio <= 0 or (args.max_iter or 1) < 1:
        parser.error("--warmup must be between 0 and 1, --lars-ratio and --max-iter above 0")
    return args


def main():
    args = parse_args()
    out = Path(args.out).resolve()
    args.out = str(out)
    written = write_variants(args)
    only = set(args.only.split(",")) if args.only else None
    commands = [f"{' '.join(command)}" for name, *_, command in written
                if only is None or name in only]
    print(f"{len(written)} variants written to {out}")
    for command in commands:
        print("  " + command)
    if args.write_only:
        return
    rows = []
    for name, batch, variant, command in written:
        if only is not None and name not in only:
            continue
        row = run_variant(name, batch, variant, command, out)
        rows.append(row)
        print(f"{name}: {row['status']}, accuracy {row['accuracy']}, {row['wall_s']:.0f} s",
              flush=True)
    text = table(rows)
    print(text)
    (out / "results.md").write_text(text + "\n\nCommands:\n\n" + "\n".join(commands) + "\n")


if __name__ == "__main__":
    main()
