"""The benchmark's report: statistics of the rounds, table, plot and progress bar.

Medians, quartiles and ratios taken round by round, the printed table, the
ceilings' lines, the plot and the progress bar.

Private: :mod:`fastattn.bench` re-exports every public name.
"""
import statistics
import sys

import numpy as np

IMPLS = ("fastattn", "torch", "numpy")
NOISY_SPREAD = 0.10  # a cell whose interquartile range over the rounds exceeds this
                     # fraction of its median is marked "~" (noisy)
CEILING_GAP = 0.20   # report in-process vs child gemm throughputs that differ by more


def _times_ms(r):
    """An implementation's times over the rounds (ms), in round order."""
    return list(r.get("times_ms") or [r["median_ms"]])


def ratio_text(num, den):
    """Format two samples of times as 'best / median' ratios.

    Parameters
    ----------
    num : sequence of float
        The numerator's times.
    den : sequence of float
        The denominator's times.

    Returns
    -------
    str
        ``min(num) / min(den)`` and ``median(num) / median(den)``, each as ``"%5.2fx"``,
        joined by " / ".

    Examples
    --------
    >>> from fastattn import bench
    >>> bench.ratio_text([2.0, 2.2, 2.4], [1.0, 1.1, 1.3])
    ' 2.00x /  2.00x'
    """
    return f"{min(num) / min(den):5.2f}x / {np.median(num) / np.median(den):5.2f}x"


def spread(xs):
    """Compute the median, quartiles and relative interquartile range of some rounds.

    Parameters
    ----------
    xs : sequence of float
        Positive numbers, one a round.

    Returns
    -------
    tuple of float
        ``(median, Q1, Q3, (Q3 - Q1) / median)``: the quartiles interpolated between
        the rounds (``statistics.quantiles``, "inclusive"); one round gives Q1 = Q3 =
        the round, and a median of 0 a spread of 0.

    Examples
    --------
    >>> from fastattn import bench
    >>> bench.spread([1.0, 2.0, 3.0, 4.0])
    (2.5, 1.75, 3.25, 0.6)
    """
    med = statistics.median(xs)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else xs * 3
    return med, q1, q3, (q3 - q1) / med if med > 0 else 0.0


def derive(row, ceil):
    """Derive a row's throughput, fraction of the ceiling and speed ratios.

    Parameters
    ----------
    row : dict
        One row of :func:`run_shape`.
    ceil : dict
        The ceilings of :func:`measure_ceilings` (missing keys give None figures).

    Returns
    -------
    dict
        ``rate`` (of fastattn's median round, GFLOP/s for prefill rows, GB/s of K/V
        read for decode rows) and ``rate_best``, ``unit``, ``rates`` of every
        implementation, ``pct_ceiling`` (of the FMA peak or the read bandwidth) and
        ``pct_gemm`` (of sgemm or dgemm), fastattn's median, quartiles and range in
        ms, and ``x_vs_torch``/``x_vs_numpy``: the median of the per-round ratios
        (the other's time / fastattn's), with their quartiles and range (None where
        the implementation did not run).  ``noisy`` flags the cells whose
        interquartile range exceeds ``NOISY_SPREAD`` of their median.
    """
    fa_t = _times_ms(row["fastattn"])
    med, q1, q3, sp = spread(fa_t)
    f64 = row["dtype"] == "float64"
    gemm = None
    if row["kind"] == "prefill":
        work, unit = row["flops"] / 1e9, "GFLOP/s"
        c, cname = ceil.get("fma_peak_f64_gflops" if f64 else "fma_peak_gflops"), "FMA peak"
        gemm = ceil.get("dgemm_gflops" if f64 else "sgemm_gflops")
    else:
        work, unit = row["bytes"] / 1e9, "GB/s"
        c, cname = ceil.get("read_gbps"), "read bw"
    rate = work / (med / 1e3)
    d = dict(rate=rate, rate_best=work / (min(fa_t) / 1e3), unit=unit, ceiling=cname,
             rates={n: work / (row[n]["median_ms"] / 1e3) for n in IMPLS if row.get(n)},
             pct_ceiling=100.0 * rate / c if c else None,
             pct_gemm=100.0 * rate / gemm if gemm else None,
             gemm="dgemm" if f64 else "sgemm",
             fastattn_ms=med, fastattn_iqr_ms=[q1, q3], fastattn_range_ms=[min(fa_t), max(fa_t)],
             fastattn_spread=sp, noisy=dict(fastattn=sp > NOISY_SPREAD))
    for n in ("torch", "numpy"):
        if not row.get(n):
            d[f"x_vs_{n}"] = d[f"x_vs_{n}_iqr"] = d[f"x_vs_{n}_range"] = None
            continue
        # the same round's times: both calls saw the same machine state
        ratios = [t / f for t, f in zip(_times_ms(row[n]), fa_t)]
        rmed, rq1, rq3, rsp = spread(ratios)
        d[f"x_vs_{n}"], d[f"x_vs_{n}_iqr"] = rmed, [rq1, rq3]
        d[f"x_vs_{n}_range"] = [min(ratios), max(ratios)]
        d["noisy"][n] = rsp > NOISY_SPREAD
    return d


# ---------------------------------------------------------------- report
CEILINGS = (("fma_peak_gflops", "FMA peak", "GFLOP/s"),
            ("fma_peak_f64_gflops", "float64 FMA peak", "GFLOP/s"),
            ("sgemm_gflops", "sgemm", "GFLOP/s"), ("dgemm_gflops", "dgemm", "GFLOP/s"),
            ("read_gbps", "read bandwidth", "GB/s"))
COLS = ("shape", "fastattn ms", "PyTorch ms", "NumPy ms", "fastattn rate", "% ceiling",
        "% gemm", "x vs PyTorch", "x vs NumPy")


def _day(iso):
    return iso[:16].replace("T", " ")  # 2024-01-31 12:34


def _num(m):
    return f"{m:.1f}" if m >= 10 else f"{m:.2f}" if m >= 0.1 else f"{m:.3f}"


def _ms(r):
    return "-" if not r else _num(r["median_ms"])


def _cell(med, iqr, noisy, x=""):
    """'median [Q1-Q3]', with '~' for a noisy one (' ' keeps the columns aligned)."""
    if med is None:
        return "- "
    f = (lambda y: f"{y:.2f}") if x else _num
    return f"{f(med)}{x} [{f(iqr[0])}-{f(iqr[1])}]{'~' if noisy else ' '}"


def ceiling_lines(c):
    """Write the report's lines about the ceilings: where and how they were measured.

    Parameters
    ----------
    c : dict
        The ceilings of :func:`measure_ceilings`.

    Returns
    -------
    list of str
        A line with the values and their source (a child process, with the BLAS
        settings it ran without, or this process and why the child failed), then a
        note for each gemm whose in-process throughput differs from the child's by
        more than ``CEILING_GAP``.

    Examples
    --------
    >>> from fastattn import bench
    >>> bench.ceiling_lines({"fma_peak_gflops": 100.0, "read_gbps": 20.0})
    ['ceilings (this run): FMA peak 100.0 GFLOP/s, read bandwidth 20.0 GB/s']
    """
    vals = ", ".join(f"{label} {c[k]:.1f} {unit}" for k, label, unit in CEILINGS if c.get(k))
    blas = f" ({c['blas']} kernels)" if c.get("blas") else ""
    src = c.get("source")
    if src == "child":
        removed = c.get("env_removed")
        how = f"; gemm timed in a child process{' without ' + ', '.join(removed) if removed else ''}{blas}"
    elif src == "in-process":
        how = f"; gemm timed in this process{blas}: the child process failed: {c.get('child_error')}"
    else:
        how = ""
    fk = f" (FMA peak: the {c['fma_kernel']} kernel's FMA chains)" if c.get("fma_kernel") else ""
    lines = [f"ceilings (this run): {vals}{fk}{how}"]
    inp = c.get("in_process") or {}
    if src == "child":
        for k, label in (("sgemm_gflops", "sgemm"), ("dgemm_gflops", "dgemm")):
            if inp.get(k) and c.get(k):
                gap = inp[k] / c[k] - 1.0
                if abs(gap) > CEILING_GAP:
                    lines.append(
                        f"note: {label} in this process (the BLAS the NumPy column runs"
                        f"{', ' + inp['blas'] if inp.get('blas') else ''}): {inp[k]:.1f} GFLOP/s, "
                        f"{abs(gap) * 100:.0f}% {'below' if gap < 0 else 'above'} the child's"
                        + ("" if gap < 0 else " (the machine's speed moved between the two)"))
    return lines


def format_table(result):
    """Format the printed report: a header, the ceilings and one line per row.

    Parameters
    ----------
    result : dict
        What ``python -m fastattn.bench --json`` writes: ``date``, ``machine``,
        ``versions``, ``env_note``, ``ceilings`` and ``rows`` (each with its
        ``derived`` figures).

    Returns
    -------
    str
        The report, ending with the oracle check's verdict.
    """
    m, c = result["machine"], result["ceilings"]
    ver = result["versions"]
    env_note = result.get("env_note")
    lines = [f"fastattn.bench  {_day(result['date'])}",
             f"CPU: {m['cpu']}  kernel: {m['kernel']}  threads: {m['threads']}",
             f"fastattn {ver['fastattn']}  numpy {ver['numpy']}  torch {ver['torch'] or '-'}"]
    lines += [env_note] if env_note else []
    lines += ceiling_lines(c)
    rounds = sorted({r["rounds"] for r in result["rows"]})
    nr = f"{rounds[0]}-{rounds[-1]}" if len(rounds) > 1 else f"{rounds[0]}" if rounds else "-"
    lines += ["prefill: B=1 H=8 D=64 float32; decode: B=1 H=32 Lq=1 D=128 float32 (unless noted)",
              f"times: medians of {nr} interleaved rounds, fastattn's with its interquartile "
              "range [Q1-Q3]; x: the other's time / fastattn's in the same round, median [Q1-Q3]",
              ""]
    cells = [COLS]
    for row in result["rows"]:
        d = row["derived"]
        noisy = d.get("noisy", {})
        cells.append((row["name"],
                      _cell(d["fastattn_ms"], d["fastattn_iqr_ms"], noisy.get("fastattn")),
                      _ms(row["torch"]), _ms(row["numpy"]),
                      f"{d['rate']:.1f} {d['unit']}",
                      "-" if d["pct_ceiling"] is None else f"{d['pct_ceiling']:.0f}% {d['ceiling']}",
                      "-" if d.get("pct_gemm") is None else f"{d['pct_gemm']:.0f}% {d['gemm']}",
                      _cell(d["x_vs_torch"], d["x_vs_torch_iqr"], noisy.get("torch"), "x"),
                      _cell(d["x_vs_numpy"], d["x_vs_numpy_iqr"], noisy.get("numpy"), "x")))
    w = [max(len(r[i]) for r in cells) for i in range(len(COLS))]
    fmt = lambda r: "  ".join(s.ljust(w[0]) if i == 0 else s.rjust(w[i]) for i, s in enumerate(r))
    lines += [fmt(cells[0]), "  ".join("-" * x for x in w)] + [fmt(r) for r in cells[1:]]
    n_noisy = sum(any(r["derived"].get("noisy", {}).values()) for r in result["rows"])
    lines += ["", f"~ noisy: the cell's interquartile range is over {NOISY_SPREAD:.0%} of its "
              f"median ((Q3-Q1)/median); {n_noisy} of {len(result['rows'])} rows have one: read "
              "them as rough (rate and % ceiling come from fastattn's median; --json has every "
              "round)."]
    bad = [f"{r['name']} (rel err {r['rel_err']:.1e} > {r['tol']:.0e})"
           for r in result["rows"] if not r["check_ok"]]
    worst = max((r["rel_err"] / r["tol"] for r in result["rows"]), default=0.0)
    lines += [f"ORACLE CHECK FAILED: {'; '.join(bad)}" if bad else
              "oracle check (every batch and head; query rows first, last and up to 6 others): "
              f"all pass, worst rel err {worst:.2g} x tolerance"]
    return "\n".join(lines)


def plot(result, path):
    """Draw the report's throughput plot into a PNG file.

    Two panels: prefill GFLOP/s against L and decode GB/s against Lk, one line per
    implementation over the rows of the plotted sweeps, each under its ceiling (the
    FMA peak, the read bandwidth) as a dashed line.

    Parameters
    ----------
    result : dict
        As for :func:`format_table`.
    path : str
        The file to write.

    Raises
    ------
    SystemExit
        If matplotlib is not installed (the message names the ``bench`` extra).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'fastattn[bench]'") from None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120)
    panels = [("prefill", "prefill (float32, B=1 H=8 D=64)", "L", "GFLOP/s", "fma_peak_gflops",
               "FMA peak"),
              ("decode", "decode (float32, B=1 H=32 D=128, Lq=1)", "Lk", "GB/s", "read_gbps",
               "read bandwidth")]
    style = {"fastattn": ("C0", "o", "fastattn"), "torch": ("C1", "s", "PyTorch SDPA"),
             "numpy": ("C2", "^", "NumPy naive")}
    for ax, (kind, title, xl, yl, ckey, cname) in zip(axes, panels):
        rows = sorted((r for r in result["rows"] if r["kind"] == kind and r["series"]),
                      key=lambda r: r["Lk"])
        for n, (col, mk, label) in style.items():
            pts = [(r["Lk"], r["derived"]["rates"][n]) for r in rows if n in r["derived"]["rates"]]
            if pts:
                ax.plot(*zip(*pts), color=col, marker=mk, label=label)
        top = max([r["derived"]["rates"].get(n, 0) for r in rows for n in style] + [1.0])
        if result["ceilings"].get(ckey):
            c = result["ceilings"][ckey]
            top = max(top, c)
            ax.axhline(c, color="0.4", ls="--", lw=1, label=f"{cname} ceiling")
            ax.annotate(f"{cname} {c:.0f} {yl}", xy=(0.01, c), xycoords=("axes fraction", "data"),
                        xytext=(0, 2), textcoords="offset points", fontsize=8, color="0.3")
        ax.set_xscale("log", base=2)
        if rows:
            ax.set_xticks([r["Lk"] for r in rows], [str(r["Lk"]) for r in rows])
        ax.set(title=title, xlabel=xl, ylabel=yl)
        ax.set_ylim(0, 1.15 * top)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    m = result["machine"]
    fig.suptitle(f"fastattn  |  {m['cpu']}  |  {m['threads']} threads  |  {_day(result['date'])}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def progress(i, n, label, stream=sys.stderr):
    """Write a progress bar line: `i` of `n` steps done, then `label`.

    On a terminal the line is redrawn in place (a newline after the last step);
    otherwise each call writes its own line.

    Parameters
    ----------
    i : int
        Steps done.
    n : int
        Steps in all, >= 1.
    label : str
        What runs now.
    stream : file, default sys.stderr
        Where to write.

    Examples
    --------
    >>> import io
    >>> from fastattn import bench
    >>> out = io.StringIO()
    >>> bench.progress(1, 4, "prefill L=512", out)
    >>> out.getvalue()
    '[=====               ] 1/4 prefill L=512\\n'
    """
    bar = "=" * round(20 * i / n)
    line = f"[{bar:<20}] {i}/{n} {label}"
    tty = stream.isatty()
    stream.write(f"\r{line:<60}" + "\n" * (i == n) if tty else line + "\n")
    stream.flush()

