"""The statistics of `cgp bench speedup`: per configuration the median rate and its spread,
speedups as ratios of medians and *paired* (the median of the ratios within each round, with a
distribution-free 95 % interval), over all rounds and over the quiet ones, and the printed
table. Works on finished timings (Config.rates, Config.steals); times nothing itself.
"""


def median_ci(values, level=0.95):
    """A distribution-free confidence interval for the median of `values` (independent
    draws): (lo, hi), the order statistics whose ranks the binomial distribution gives, so
    that the true median lies between them with at least that probability. None when there
    are too few values for the level (at 95 %, fewer than 6)."""
    from math import comb

    n = len(values)
    # k: how many values may lie below lo (and above hi) while both tails of
    # Binomial(n, 1/2) beyond them stay within (1 - level) / 2.
    tail, k = 0.0, -1
    while k + 1 < n and tail + comb(n, k + 1) / 2 ** n <= (1 - level) / 2:
        k += 1
        tail += comb(n, k) / 2 ** n
    if k < 0:
        return None
    ordered = sorted(values)
    return ordered[k], ordered[n - 1 - k]


def _paired(rates, base):
    """The per-round ratios rates / base: their median and its 95 % interval (or None)."""
    import statistics

    ratios = [r / b for r, b in zip(rates, base)]
    ci = median_ci(ratios)
    return statistics.median(ratios), ci and [round(ci[0], 4), round(ci[1], 4)]


# A timing is "quiet" when the hypervisor withheld at most this share of the CPUs' time.
QUIET_STEAL = 0.01


def summarise(configs):
    """Rows per configuration with median, spread and speedup over the 1-thread median of
    the same implementation and layout (the ceiling's: over cgp's); cgp rows also get
    cgp/torch against the faster PyTorch layout, and their share of the ceiling, at that
    thread count. Ratios also come paired: the median of the ratios
    within each round, with its 95 % confidence interval, and over the quiet rounds alone:
    those where neither timing lost more than QUIET_STEAL of the CPUs to the hypervisor."""
    import statistics

    rows = []
    for c in configs:
        # The ceiling's copies and MPI ranks run cgp's training: their speedup is over its
        # 1 thread.
        base = next(b for b in configs if b.threads == 1 and (
            b.impl == "cgp" if c.impl in ("ceiling", "mpi")
            else (b.impl, b.layout) == (c.impl, c.layout)))
        median = statistics.median(c.rates)
        speedup = median / statistics.median(base.rates)
        # The same ratio taken within each round, whose timings lie minutes closer together:
        # on a shared machine it is less swayed by a slow spell than the ratio of medians.
        paired, paired_ci = _paired(c.rates, base.rates)
        quiet = [i for i, (s, b) in enumerate(zip(c.steals, base.steals))
                 if max(s, b) <= QUIET_STEAL]
        quiet_paired, quiet_ci = (_paired([c.rates[i] for i in quiet],
                                          [base.rates[i] for i in quiet]) if quiet
                                  else (None, None))
        rows.append({"impl": c.impl, "layout": c.layout, "threads": c.threads,
                     "images_per_s": [round(r, 2) for r in c.rates],
                     "steal": [round(x, 4) for x in c.steals],
                     "quiet_rounds": len(quiet),
                     "quiet_paired_speedup": quiet_paired and round(quiet_paired, 4),
                     "quiet_paired_speedup_ci": quiet_ci,
                     "median": round(median, 2), "min": round(min(c.rates), 2),
                     "max": round(max(c.rates), 2), "speedup": round(speedup, 4),
                     "efficiency": round(speedup / c.threads, 4),
                     "paired_speedup": round(paired, 4), "paired_speedup_ci": paired_ci})
    best = {}   # threads -> the faster torch row
    for row in rows:
        if row["impl"] == "torch" and (row["threads"] not in best
                                       or row["median"] > best[row["threads"]]["median"]):
            best[row["threads"]] = row
    for row, c in zip(rows, configs):
        if row["impl"] == "cgp" and row["threads"] in best:
            t = best[row["threads"]]
            row["cgp_over_torch"] = round(row["median"] / t["median"], 4)
            paired, paired_ci = _paired(c.rates, t["images_per_s"])
            row["paired_cgp_over_torch"] = round(paired, 4)
            row["paired_cgp_over_torch_ci"] = paired_ci
    ceiling = {c.threads: c for c in configs if c.impl == "ceiling"}
    for row, c in zip(rows, configs):
        if row["impl"] == "cgp" and row["threads"] in ceiling:
            top = ceiling[row["threads"]]
            row["share_of_ceiling"] = round(row["median"] / statistics.median(top.rates), 4)
            paired, paired_ci = _paired(c.rates, top.rates)
            row["paired_share_of_ceiling"] = round(paired, 4)
            row["paired_share_of_ceiling_ci"] = paired_ci
    return rows, best


def _with_ci(value, ci):
    """'1.71 (1.62-1.78)': a paired ratio and its 95 % interval, when there is one."""
    return f"{value:.2f}" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")


def table(rows, best):
    """The printed table: a line per cgp row, then the quiet rounds' speedups. A workers
    column appears when the run timed more than one kind (cgp_config)."""
    cgp = [r for r in rows if r["impl"] == "cgp"]
    kinds = len({r["layout"] for r in cgp}) > 1

    def workers(row):
        return f"{row['layout'] or 'threads':<9}  " if kinds else ""
    lines = [f"{'threads':>7}  {'workers':<9}  " * kinds + f"{'cgp img/s':>10}  {'min-max':>15}  "
             f"{'speedup':>7}  {'efficiency':>10}  {'paired (95% CI)':>16}"
             + (f"  {'torch img/s':>11}  {'layout':<13}  {'cgp/torch':>9}  "
                f"{'paired (95% CI)':>16}" if best else "")]
    for row in cgp:
        line = (f"{row['threads']:>7}  {workers(row)}{row['median']:>10.1f}  "
                f"{row['min']:>7.0f}-{row['max']:<7.0f}  {row['speedup']:>7.2f}  "
                f"{100 * row['efficiency']:>9.0f}%  "
                f"{_with_ci(row['paired_speedup'], row['paired_speedup_ci']):>16}")
        t = best.get(row["threads"])
        if t:
            line += (f"  {t['median']:>11.1f}  {t['layout']:<13}  {row['cgp_over_torch']:>9.2f}"
                     f"  {_with_ci(row['paired_cgp_over_torch'], row['paired_cgp_over_torch_ci']):>16}")
        lines.append(line)
    for top in (r for r in rows if r["impl"] == "ceiling"):
        reached = "; ".join(
            f"cgp{' as ' + (r['layout'] or 'threads') if kinds else ''} reaches "
            f"{r['share_of_ceiling']:.2f} of it, paired "
            f"{_with_ci(r['paired_share_of_ceiling'], r['paired_share_of_ceiling_ci'])}"
            for r in cgp if r["threads"] == top["threads"])
        lines.append(f"machine ceiling, {top['threads']} copies of the 1-thread training at "
                     f"once, each in a process of its own: {top['median']:.1f} img/s in all, "
                     f"speedup {top['speedup']:.2f}, paired "
                     f"{_with_ci(top['paired_speedup'], top['paired_speedup_ci'])}; {reached}")
    for row in (r for r in rows if r["impl"] == "mpi"):
        lines.append(f"{row['ranks']} MPI ranks x {row['threads'] // row['ranks']} "
                     f"{row['layout'] and 'workers'}: {row['median']:.1f} img/s, speedup "
                     f"{row['speedup']:.2f} (efficiency {100 * row['efficiency']:.0f}%), paired "
                     f"{_with_ci(row['paired_speedup'], row['paired_speedup_ci'])}; "
                     f"communication {row['comm_ms_per_step']:.3f} ms a step, "
                     f"{100 * row['comm_hidden_share']:.0f}% of it hidden behind backward; a "
                     f"rank sends {row['bytes_sent_per_step'] / 2**20:.2f} MiB and receives "
                     f"{row['bytes_received_per_step'] / 2**20:.2f} MiB a step")
    for row in (r for r in cgp if r["threads"] > 1):
        rounds = len(row["images_per_s"])
        quiet = (f"paired speedup there {_with_ci(row['quiet_paired_speedup'], row['quiet_paired_speedup_ci'])}"
                 if row["quiet_rounds"] else "none")
        lines.append(f"quiet rounds, {row['threads']} threads"
                     f"{' as ' + (row['layout'] or 'threads') if kinds else ''} (the hypervisor "
                     f"withheld at most {100 * QUIET_STEAL:g}% of the CPUs' time in both "
                     f"timings): {row['quiet_rounds']} of {rounds}; {quiet}")
    return lines
