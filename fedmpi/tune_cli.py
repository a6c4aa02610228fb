"""``fedmpi tune STUDY``: run a tuning study's trials (fedmpi.tune, fedmpi.tune_worker),
or show where it stands and its best trials.

Every worker runs the same command: alone, under mpirun/srun (rank 0 talks to Optuna,
every rank runs the trial), or as N SLURM array tasks on one study
(jobs/slurm/array_tune.sbatch). Registered in ``fedmpi/cli.py``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import click

from .errors import UsageError, one_line_errors
from .signals import launcher_rank

# deferred imports: `fedmpi --help` loads this module; each branch imports what it runs
# (torch with the runtime, Optuna with the study), as fedmpi/cli.py's commands do

@click.command()
@click.argument("study_file")
@click.option("--best", is_flag=True,
              help="Print each method's best trial (a multi-objective study: its Pareto "
                   "front), with its parameters and results file.")
@click.option("--status", "show_status", is_flag=True,
              help="Print each method's trials so far against the budget.")
@click.option("--max-trials", type=click.IntRange(min=1), metavar="N",
              help="Run at most N trials here (new or resumed), then stop; default: until "
                   "every method's budget is spent.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config field in every trial (repeatable).")
@click.option("--outdir", metavar="DIR",
              help="The study goes to DIR/<study name>/ (default: the file's outdir, else runs).")
@click.option("-q", "--quiet", is_flag=True, help="No per-round progress lines.")
@one_line_errors
def tune(study_file, best, show_status, max_trials, overrides, outdir, quiet):
    """Tune STUDY_FILE: Optuna trials of fedmpi runs, the same budget for every method.

    Exit codes: 0 the budget is spent (or --max-trials ran), 1 a trial crashed, 2 bad
    input, 75 a trial checkpointed on SIGUSR1/SIGTERM (run the same command again: the
    trial resumes).
    """
    from . import tune as tunes
    from .config.sources import refuse_spaced_value

    if best and show_status:
        raise UsageError("--best and --status do not go together; choose one")
    if (best or show_status) and max_trials is not None:
        raise UsageError("--max-trials applies to running trials, not to --best or --status")
    if (best or show_status) and launcher_rank():
        return
    refuse_spaced_value(overrides, [study_file])
    study = tunes.load(study_file, outdir=outdir, overrides=overrides)
    try:
        if best or show_status:
            from .tune_report import summary
            click.echo(summary(study, best))
            return
        _work(study, max_trials, quiet)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"study journal {study.journal} is damaged (a line that is not "
                         f"Optuna's JSON: {exc}); restore it from a copy, or give the study "
                         f"another outdir") from None


def _work(study, max_trials, quiet) -> None:
    from . import api, tune_worker as worker
    from .comm import make_comm
    from .runtime import EXIT_PREEMPTED, run_experiment
    from .runtime.observers.pruning import Pruning

    comm = make_comm()
    server = comm.is_server
    speak = server and not quiet
    store = worker.storage(study) if server else None
    done = 0
    while max_trials is None or done < max_trials:
        claim = worker.claim(study, store) if server else None
        claim = comm.bcast_obj(claim)
        comm.ledger.take()   # the claim is the study's traffic, not the trial's
        if claim is None:
            if speak:
                click.echo(f"study {study.name}: every method's budget ({study.trials} trials) "
                           f"is spent; fedmpi tune {study.path} --best")
            break
        method = study.method(claim.method)
        where = f"trial {claim.method}/{claim.number}"
        back = None   # a resumed trial runs from where it started (its relative data paths)
        try:
            if claim.resume:
                config, back = api.resume_config(claim.output, speak=server)
            else:
                config = study.config(method, claim.params, Path(claim.output))
                api.prepare(config, force=False)
        except UsageError as exc:   # a point the config refuses (every rank alike): a
            if server:              # failed trial, and the study goes on
                worker.fail(study, store, claim, exc)
                click.echo(f"fedmpi: {where}: refused, marked failed: {exc}", err=True)
            done += 1
            continue
        if speak:
            shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in claim.params.items())
            click.echo(f"{where} ({shown}): {'resuming' if claim.resume else 'fresh run'} -> "
                       f"{claim.output}")
        judge = worker.Judge(study, store, claim) if server else None
        try:
            experiment = run_experiment(config, comm, quiet=quiet, resume=claim.resume,
                                        observers=[Pruning(judge)])
        except BaseException as exc:
            if server:
                worker.fail(study, store, claim, exc)
            raise
        finally:
            if back is not None:
                os.chdir(back)
        if experiment.preempted:
            sys.exit(EXIT_PREEMPTED)
        if server:
            outcome = worker.tell(study, store, claim)
            if not quiet:
                click.echo(f"{where}: {outcome}")
        del experiment
        gc.collect()
        comm.release_shared()   # this trial's dataset windows, before the next trial's
        done += 1
