"""``fedmpi sweep FILE``: list, count, show and run the cells of a sweep (``fedmpi.sweep``).

Job scripts run one cell per job (or array task) with ``--run-cell I`` under srun or
mpirun: every rank runs the same command, reads the same sweep and the same results
file, and so takes the same decision (completed: nothing to do; file exists: resume;
no file: fresh run; a file of another config: refused) before any rank can change the
file: rank 0 creates or reopens it only after every rank has joined the run's first
collective.

Registered in ``fedmpi/cli.py`` with ``main.add_command(sweep)``.
"""

from __future__ import annotations

import shlex

import click

from . import sweep as sweeps
from .config.sources import refuse_spaced_value
from .errors import UsageError, one_line_errors
from .signals import launcher_rank


@click.command()
@click.argument("sweep_file")   # a plain string: the loader says what is wrong in one line
@click.option("--count", is_flag=True, help="Print the number of cells (sbatch --array=0-(N-1)).")
@click.option("--cell", "cell_index", type=int, metavar="I", help="Show cell I only.")
@click.option("--print-args", is_flag=True,
              help="With --cell I: print the `fedmpi run` arguments that complete cell I "
                   "(shell-quoted, for eval).")
@click.option("--run-cell", type=int, metavar="I",
              help="Run cell I here (on every rank under srun/mpirun): completed -> nothing; "
                   "results file exists -> resume it; none -> a fresh run; a file of another "
                   "config (the sweep edited since) -> refused, naming the fields.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config field in every cell (repeatable).")
@click.option("--outdir", metavar="DIR",
              help="Results go to DIR/<sweep name>/ (default: the sweep's outdir, else runs).")
@click.option("--force", is_flag=True, help="With --run-cell: start afresh over an existing file.")
@click.option("-q", "--quiet", is_flag=True, help="With --run-cell: no progress lines.")
@one_line_errors
def sweep(sweep_file, count, cell_index, print_args, run_cell, overrides, outdir, force, quiet):
    """Cells of SWEEP_FILE (a sweep, or a plain config = one cell): list, count, run.

    Exit codes with --run-cell are those of `fedmpi run`: 0 done (or already
    completed), 1 diverged or crashed, 2 bad input, 75 checkpointed on SIGUSR1/SIGTERM.
    """
    _check_options(count, cell_index, print_args, run_cell, force, quiet)
    if run_cell is None and launcher_rank():
        return   # listing and counting are one process's work, as every command but run's
    refuse_spaced_value(overrides, [sweep_file])   # `--set train.lr 0.1`: 0.1 is no sweep file
    plan = sweeps.load(sweep_file, outdir=outdir, overrides=overrides)
    if count:
        click.echo(len(plan))
    elif run_cell is not None:
        _run_cell(plan, plan.cell(run_cell), force, quiet)
    elif print_args:
        click.echo(shlex.join(sweeps.run_arguments(plan, plan.cell(cell_index))))
    else:
        cells = plan.cells if cell_index is None else [plan.cell(cell_index)]
        _list(plan, cells, header=cell_index is None)


def _check_options(count, cell_index, print_args, run_cell, force, quiet) -> None:
    chosen = [name for name, on in (("--count", count), ("--cell", cell_index is not None),
                                    ("--run-cell", run_cell is not None)) if on]
    if len(chosen) > 1:
        raise UsageError(f"{' and '.join(chosen)} do not go together; choose one")
    if print_args and cell_index is None:
        raise UsageError("--print-args needs --cell I")
    if (force or quiet) and run_cell is None:
        raise UsageError("--force and --quiet apply to --run-cell I only")


def _which(plan, cell) -> str:
    return f"config {plan.path}" if plan.single else \
        f"sweep {plan.path}, cell {cell.index} ({cell.name})"


def _what(plan) -> str:
    return "config" if plan.single else "sweep"


def _list(plan, cells, header: bool) -> None:
    """With the header: one line per cell (index, status, name); one cell: also its file."""
    if header and plan.single:
        click.echo(f"config {plan.path}: one run, results in {plan.cells[0].output}")
    elif header:
        click.echo(f"sweep {plan.name}: {len(plan)} cells over {', '.join(plan.grid) or 'no grid'} "
                   f"({' '.join(plan.base)}); results in {plan.cells[0].output.parent}/<name>.h5")
    width = len(str(len(plan) - 1))
    for cell in cells:
        try:
            status, changes = sweeps.cell_state(plan, cell)
        except UsageError:
            status, changes = "unreadable", []
        status = "changed" if changes else status
        where = "" if header else f"  {cell.output}"
        click.echo(f"{cell.index:>{width}}  {status:<11}  {cell.name}{where}")
        if changes and not header:
            click.echo(f"   its file holds a run of another config: {'; '.join(changes)}")


def _run_cell(plan, cell, force: bool, quiet: bool) -> None:
    """Complete one cell through `fedmpi run` in this process (same code, same exit codes)."""
    from .cli import main   # deferred: fedmpi.cli imports this module (a cycle at load time)

    speak = launcher_rank() == 0 and not quiet
    status, changes = sweeps.cell_state(plan, cell)
    if changes and not force:
        raise UsageError(f"{_which(plan, cell)}: {cell.output} holds a run of another config "
                         f"({'; '.join(changes)}); restore the {_what(plan)} to continue that "
                         f"run, or pass --force to start afresh over it"
                         f"{'' if plan.single else ' (another sweep name or outdir keeps both)'}")
    if status == "completed" and not force:
        if speak:
            click.echo(f"cell {cell.index} ({cell.name}): completed in {cell.output}; nothing to do")
        return
    args = sweeps.run_arguments(plan, cell, force=force) + (["--quiet"] if quiet else [])
    if speak:
        what = "fresh run" if status == "missing" or force else f"resuming ({status})"
        click.echo(f"cell {cell.index} ({cell.name}): {what} -> {cell.output}")
    cell.output.parent.mkdir(parents=True, exist_ok=True)
    try:
        main.main(args=["run", *args], prog_name="fedmpi", standalone_mode=False)
    except click.ClickException as exc:   # cannot happen for arguments we built; kept one line
        raise UsageError(f"fedmpi run {shlex.join(args)}: {exc.format_message()}") from None
