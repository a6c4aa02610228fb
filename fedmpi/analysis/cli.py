"""Click commands over fedmpi.analysis: ``report``, ``plot``, ``watch``.

``fedmpi/cli.py`` registers them (``main.add_command(report)`` ...); until then, and
for debugging, ``python -m fedmpi.analysis.cli report ...`` runs the same commands.
Options are taken as text and checked here, so every bad value is the usual one-line
``fedmpi: ...`` message with exit code 2, like the rest of fedmpi.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import click

from fedmpi.analysis import SkippedFileWarning, load
from fedmpi.analysis.plot import save_plot
from fedmpi.analysis.report import confound_line, report_table
from fedmpi.analysis.run_summary import summarize
from fedmpi.analysis.watch import watch as follow
from fedmpi.errors import UsageError, one_line_errors


def _sources(command):
    command = click.option("--strict", is_flag=True,
                           help="Stop at a file in a directory/glob that is not a fedmpi results "
                                "file (default: skip it with a warning).")(command)
    return click.argument("sources", nargs=-1, required=True, metavar="FILES_OR_DIRS...")(command)


def _grouping(command):
    command = click.option("--smooth", metavar="BETA",
                           help="Use the EMA of the accuracy curve, e.g. 0.9 (as FedACG reports).")(command)
    return click.option("-g", "--group-by", multiple=True, metavar="KEY",
                        help="Config key to group runs by, e.g. partition.alpha (repeatable).")(command)


@click.command()
@_sources
@_grouping
@click.option("--at", multiple=True, metavar="ROUND", help="Accuracy at this round (repeatable).")
@click.option("--target", multiple=True, metavar="ACC",
              help="Rounds to reach this accuracy: 0.8 or 80% (repeatable).")
@click.option("--window", multiple=True, metavar="START:END",
              help="Mean of the raw (never smoothed) accuracy over rounds START..END, e.g. "
                   "60:100 (repeatable).")
@click.option("--format", "fmt", metavar="text|csv|markdown", help="Output format (default text).")
@click.option("--columns", multiple=True, metavar="LIST",
              help="Columns to show, comma-separated: acc,window,final,best,rounds,hours,traffic,"
                   "upload,per_round,time,vtime,norm,kappa,rho,probes (hours, vtime: runs with the "
                   "virtual clock; upload: MB uploaded; per_round: MB down + up per round; norm: "
                   "the final model's L2 norm, only when named here).")
@click.option("--completed-only", is_flag=True, help="Leave out runs that did not complete.")
@click.option("--summary", is_flag=True, help="A summary per run instead of a table.")
@one_line_errors
def report(sources, strict, group_by, smooth, at, target, window, fmt, columns, completed_only, summary):
    """Summarise one run, or tabulate many grouped by config (mean ± std over seeds).

    One results file and no table options: the run's summary. Otherwise one row per
    group of runs (default: algorithm.name plus every config key that differs between
    the runs, seed excepted), with accuracy at --at rounds, final and best accuracy,
    rounds to --target accuracies, FL traffic (MB), wall time, kappa and rho; for runs
    with the virtual clock (system_model) also the virtual hours to each --target (H@x)
    and in all (virtual h).
    """
    runs = load_runs(sources, strict, completed_only)
    table_options = group_by or at or target or window or smooth or fmt or columns
    if summary or (len(runs) == 1 and not table_options):
        click.echo("\n\n".join(summarize(run.path) for run in runs))
        return
    click.echo(report_table(runs, group_by=list(group_by), at=parse_rounds(at), targets=parse_targets(target),
                            smooth=parse_smooth(smooth), columns=parse_columns(columns), fmt=fmt or "text",
                            windows=parse_windows(window)),
               nl=fmt != "csv")
    also = confound_line(runs, list(group_by)) if fmt == "csv" else ""
    if also:   # the text and Markdown tables carry it; the CSV stays a table a program reads
        for line in also.splitlines():
            click.echo(f"fedmpi report: {line}", err=True)


@click.command()
@_sources
@_grouping
@click.option("-o", "--output", metavar="FILE", help="Figure file: .png (or .pdf, .svg).")
@click.option("--x", "x_axis", default="round", metavar="round|traffic|upload|time|vtime",
              help="x axis: round, cumulative FL traffic (MB), cumulative upload (MB, what "
                   "compression cuts), wall time (s) or virtual time (h, runs with "
                   "system_model.profiles on); default round.")
@click.option("--title", help="Figure title (default: the settings all runs share).")
@click.option("--log-x", is_flag=True, help="A logarithmic x axis (for traffic across codecs "
                                            "that differ by orders of magnitude).")
@click.option("--y-from", metavar="ACC",
              help="Start the accuracy axis at ACC (0.6 or 60%), to tell apart curves that "
                   "end a point apart.")
@click.option("--spectrum", is_flag=True,
              help="Plot the feature spectrum of self-supervised runs instead (/eval: the top "
                   "100 singular values, log10, of each run's last probe; FedU^2 Figure 3).")
@click.option("--paper", metavar="NAME",
              help="Name each run's line as that paper's tables name its method (fedacg, "
                   "fedu2, ...: tools/paper_table.py's layouts), e.g. FedU2-BYOL.")
@one_line_errors
def plot(sources, strict, group_by, smooth, output, x_axis, title, log_x, y_from, spectrum,
         paper):
    """Plot test accuracy of runs against rounds, FL traffic, wall or virtual time into one figure.

    One line per run, or with --group-by one line per group (the mean, with a band of
    ± one std over its runs).
    """
    if not output:
        raise UsageError("fedmpi plot needs -o FILE, e.g. -o fig.png")
    if y_from is not None and spectrum:
        raise UsageError("--y-from is for accuracy curves; --spectrum plots singular values")
    y_from = None if y_from is None else parse_accuracy("--y-from", y_from)
    runs = load_runs(sources, strict, False)
    path = save_plot(runs, output, x=x_axis, group_by=list(group_by), smooth=parse_smooth(smooth),
                     title=title, spectrum=spectrum, log_x=log_x, y_from=y_from, paper=paper)
    click.echo(f"wrote {path}")


MIN_INTERVAL = 0.1   # seconds: --interval 1e-9 took 56 % of a core from the run it watched


@click.command()
@click.argument("file")
@click.option("--interval", default="2", metavar="SECONDS",
              help="Seconds between polls (default 2, at least 0.1).")
@click.option("--once", is_flag=True, help="Print the current state and exit.")
@click.option("--wait", is_flag=True,
              help="With --once too, wait for FILE to appear (without --once a missing FILE, "
                   "a job still queued, is always waited for).")
@click.option("--timeout", metavar="SECONDS",
              help="Give up with exit code 124 when FILE has not appeared, or no new round "
                   "has come, for SECONDS (for scripts).")
@one_line_errors
def watch(file, interval, once, wait, timeout):
    """Follow a running experiment's results file: a line per round until it ends.

    A FILE that does not exist yet (a job still queued) is waited for, saying so once on
    stderr; --timeout SECONDS bounds the wait. A run whose process died is noticed: at
    once on the host it ran on, from another host after no new round for 30 times its
    median round time (at least 30 min).

    \b
    Exit code:   0 completed (or still running, with --once)
                 1 failed, or crashed (its process is gone)
                75 interrupted (preempted; `fedmpi run --resume FILE` continues it)
                 2 bad input, or a damaged file
               124 --timeout SECONDS passed without FILE or a new round
               130 Ctrl-C
    """
    seconds = parse_seconds("--interval", interval, least=MIN_INTERVAL)
    limit = None if timeout is None else parse_seconds("--timeout", timeout)
    # a file that is there is read at once (a directory or a damaged file: exit 2 at once)
    wait = wait or not (once or os.path.exists(file))
    sys.exit(follow(file, interval=seconds, once=once, wait=wait, echo=click.echo, timeout=limit,
                    note=lambda line: click.echo(f"fedmpi: {line}", err=True)))


def load_runs(sources, strict: bool, completed_only: bool):
    """fedmpi.analysis.load with each skipped file reported on stderr, one line each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SkippedFileWarning)
        runs = load(list(sources), strict=strict)
    for warning in caught:
        click.echo(f"fedmpi: {warning.message}", err=True)
    if completed_only:
        runs = [run for run in runs if run.completed]
        if not runs:
            raise UsageError("--completed-only: none of the runs completed")
    return runs


def parse_number(option: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"{option} {text!r}: expected a number") from None


def parse_seconds(option: str, text: str, least: float = 0.0) -> float:
    seconds = parse_number(option, text)
    if not 0 < seconds < math.inf:
        raise UsageError(f"{option} {text}: seconds must be a finite number > 0")
    if seconds < least:
        raise UsageError(f"{option} {text}: give at least {least} s; each poll reads the file, "
                         f"and polling faster takes a core from the run it watches")
    return seconds


def parse_rounds(values) -> list[int]:
    out = []
    for text in values:
        if not text.strip().isdigit() or int(text) < 1:
            raise UsageError(f"--at {text!r}: expected a round number >= 1")
        out.append(int(text))
    return list(dict.fromkeys(out))   # --at 50 --at 50: one column (a CSV's names stay unique)


def parse_windows(values) -> list[tuple[int, int]]:
    """START:END round pairs, 1 <= START <= END."""
    out = []
    for text in values:
        start, _, end = text.strip().partition(":")
        if not (start.isdigit() and end.isdigit()) or not 1 <= int(start) <= int(end):
            raise UsageError(f"--window {text!r}: expected START:END, rounds with 1 <= START <= END, "
                             "e.g. 60:100")
        out.append((int(start), int(end)))
    return list(dict.fromkeys(out))


def parse_targets(values) -> list[float]:
    """0.8 or 80%: accuracies are fractions in the files, percent in the papers."""
    return list(dict.fromkeys(parse_accuracy("--target", text) for text in values))


def parse_accuracy(option: str, text: str) -> float:
    """An accuracy given as a fraction in (0, 1] (0.8) or a percentage (80%)."""
    percent = text.strip().endswith("%")
    number = parse_number(option, text.strip().rstrip("%"))
    value = number / 100 if percent else number
    if not 0 < value <= 1 or (not percent and number > 1):
        raise UsageError(f"{option} {text!r}: give a fraction in (0, 1] such as 0.8, "
                         "or a percentage such as 80%")
    return value


def parse_smooth(text) -> float | None:
    if text is None:
        return None
    beta = parse_number("--smooth", text)
    if not 0 < beta < 1 or math.isnan(beta):
        raise UsageError(f"--smooth {text}: the EMA factor must be in (0, 1), e.g. 0.9")
    return beta


def parse_columns(values) -> list[str]:
    return list(dict.fromkeys(c.strip() for text in values for c in text.split(",") if c.strip()))


@click.group()
def commands():
    """fedmpi's analysis commands (normally run as `fedmpi report|plot|watch`)."""


commands.add_command(report)
commands.add_command(plot)
commands.add_command(watch)

if __name__ == "__main__":
    commands()
