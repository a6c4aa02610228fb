"""Run a tuning study (fedmpi.tune) on Optuna: claim a trial, run it as a fedmpi run with
its own results file, tell Optuna what the file says; until every method has spent its
budget.

**Storage.** Optuna's journal file (``{outdir}/{name}/study.journal``): an append-only
file with file locks, so N workers (SLURM array tasks, several nodes on one shared file
system) share one study without a database server. Each method is an Optuna study of
its own in that journal (``{name}.{method}``), with its own sampler and the same budget.

**Claims** happen under a lock of their own (``claims.lock`` beside the journal), so
the count of a method's trials and the new trial are one step: N workers never run more
than the budget, nor one trial twice. A claim first takes back a trial left running by a
worker that is gone: its results file says interrupted, failed or crashed and was
written after the trial's last claim (a claim older than its file: the run started, then
stopped); such a trial resumes from its checkpoint, bitwise as ``fedmpi run --resume``.
Otherwise the method with the fewest trials below its budget gets a new one. The
sampler's seed is keyed by (study seed, method, trials so far): one worker's study is
reproducible, and concurrent workers do not draw the same points.

**Ranks.** Under mpirun/srun only rank 0 talks to Optuna; it broadcasts each claim, every
rank runs the trial, and the pruner's verdict reaches the workers as divergence does.

**Outcomes.** A completed run -> its objectives (COMPLETE; a NaN one -> FAIL); a pruned
one -> PRUNED; a diverged one -> COMPLETE with the objectives of the rounds it ran (a
learning rate that diverges is a result the sampler should see); a preempted one stays
RUNNING and the worker exits 75; an exception marks the trial FAIL and is raised.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from .analysis import metrics
from .analysis.runs import Run
from .config import toml_value
from .errors import UsageError, warn
from .results import RunFile, liveness
from .tune import Study

# deferred imports: Optuna, an optional extra (pip install 'fedmpi[tune]'), only where a
# study touches it, so that a missing one is a one-line error (optuna_module)

RESUMABLE = ("interrupted", "failed", "crashed")
ENDED = ("completed", "pruned")
ABANDONED = 3600.0   # seconds: a claim whose run never wrote its file is given up after this
UNTOLD = 60.0        # seconds: a run that ended this long ago and was never told, is told


@dataclass
class Claim:
    method: str
    number: int          # the trial's number in its method's study
    trial_id: int
    params: dict
    output: str
    resume: bool


def optuna_module():
    try:
        import optuna   # deferred: an optional extra, loaded by fedmpi tune alone
    except ImportError:
        raise UsageError("fedmpi tune needs Optuna: pip install 'fedmpi[tune]' "
                         "(optuna>=4,<6)") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def storage(study: Study):
    optuna = optuna_module()
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    study.directory.mkdir(parents=True, exist_ok=True)
    path = str(study.journal)
    _drop_partial_line(study.journal, JournalFileOpenLock(path))
    return optuna.storages.JournalStorage(
        JournalFileBackend(path, lock_obj=JournalFileOpenLock(path)))


def _drop_partial_line(journal: Path, lock) -> None:
    """A journal whose last line was cut short (a worker killed, or its node lost, while
    appending) loses that line: Optuna skips it when it is last, but the next append
    would make it a broken line inside the file. Under the journal's own lock, so no
    write is in progress."""
    if not journal.exists() or _ends_whole(journal):
        return
    while not lock.acquire():
        time.sleep(0.05)
    try:
        if _ends_whole(journal):
            return
        data = journal.read_bytes()
        keep = data.rfind(b"\n") + 1
        with open(journal, "r+b") as f:
            f.truncate(keep)
        warn(f"fedmpi: study journal {journal}: dropped its cut-short last line "
             f"({len(data) - keep} bytes: a write that never finished); the study goes on")
    finally:
        lock.release()


def _ends_whole(journal: Path) -> bool:
    with open(journal, "rb") as f:
        f.seek(0, 2)
        if f.tell() == 0:
            return True
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def optuna_study(study: Study, method, store, trials_so_far: int = 0):
    """The method's Optuna study; its sampler seeded by (seed, method, trials so far)."""
    optuna = optuna_module()
    seed = zlib.crc32(f"{study.seed}/{method.name}/{trials_so_far}".encode())
    sampler = (optuna.samplers.TPESampler(seed=seed, **_startup(study.sampler_startup))
               if study.sampler == "tpe" else optuna.samplers.RandomSampler(seed=seed))
    return optuna.create_study(study_name=f"{study.name}.{method.name}", storage=store,
                               sampler=sampler, pruner=_pruner(study), load_if_exists=True,
                               directions=study.directions)


def _startup(count):
    return {} if count is None else {"n_startup_trials": count}


def _pruner(study: Study):
    optuna = optuna_module()
    if study.pruner == "median":
        return optuna.pruners.MedianPruner(n_warmup_steps=study.pruner_warmup,
                                           **_startup(study.pruner_startup))
    if study.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    if study.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


class ClaimLock:
    """The claims' own lock (Optuna's open-file lock on ``claims.lock``: NFS-safe)."""

    def __init__(self, study: Study):
        optuna_module()
        from optuna.storages.journal import JournalFileOpenLock

        self.lock = JournalFileOpenLock(str(study.directory / "claims"))

    def __enter__(self):
        while not self.lock.acquire():
            time.sleep(0.05)

    def __exit__(self, *exc):
        self.lock.release()


def claim(study: Study, store) -> Claim | None:
    """The next trial this worker runs, or None when every budget is spent."""
    with ClaimLock(study):
        taken = _take_back(study, store)
        if taken is not None:
            return taken
        counts = {m.name: len(optuna_study(study, m, store).get_trials(deepcopy=False))
                  for m in study.methods}
        open_ = [m for m in study.methods if counts[m.name] < study.trials]
        if not open_:
            return None
        method = min(open_, key=lambda m: counts[m.name])   # ties: the file's order
        target = optuna_study(study, method, store, counts[method.name])
        trial = target.ask()
        params = {d.key: suggest(trial, d) for d in method.space}
        output = str(study.output(method, trial.number))
        trial.set_user_attr("claimed", time.time())
        trial.set_user_attr("output", output)
        return Claim(method.name, trial.number, trial._trial_id, params, output, resume=False)


def suggest(trial, dimension):
    """The trial's value of one dimension (categories of lists or tables by their TOML text)."""
    d = dimension
    if d.kind == "choice":
        plain = all(isinstance(c, (bool, int, float, str)) for c in d.choices)
        if plain:
            return trial.suggest_categorical(d.key, list(d.choices))
        texts = [toml_value(c) for c in d.choices]
        return d.choices[texts.index(trial.suggest_categorical(d.key, texts))]
    if d.kind == "int":
        return trial.suggest_int(d.key, d.low, d.high, step=d.step or 1, log=d.log)
    return trial.suggest_float(d.key, float(d.low), float(d.high), step=d.step, log=d.log)


def _take_back(study: Study, store) -> Claim | None:
    optuna = optuna_module()
    running = optuna.trial.TrialState.RUNNING
    for method in study.methods:
        for trial in optuna_study(study, method, store).get_trials(deepcopy=False,
                                                                    states=(running,)):
            output = trial.user_attrs.get("output")
            claimed = trial.user_attrs.get("claimed", 0.0)
            path = Path(output) if output else None
            if path is None:
                continue
            if path.exists():
                status, written = file_status(path), path.stat().st_mtime
                if status in ENDED and written > claimed and time.time() - written > UNTOLD:
                    # its worker died between the run's end and telling Optuna
                    tell(study, store, Claim(method.name, trial.number, trial._trial_id,
                                             {}, output, resume=False))
                    continue
                if status not in RESUMABLE or written <= claimed:
                    continue
                resume = True
            elif time.time() - claimed > ABANDONED:
                resume = False
            else:
                continue
            store.set_trial_user_attr(trial._trial_id, "claimed", time.time())
            params = {key: _value(method, key, value) for key, value in trial.params.items()}
            return Claim(method.name, trial.number, trial._trial_id, params, output, resume)
    return None


def _value(method, key, value):
    """A stored categorical of lists or tables back to the value (see ``suggest``)."""
    for d in method.space:
        if d.key == key and d.kind == "choice" and value not in d.choices:
            return next(c for c in d.choices if toml_value(c) == value)
    return value


def file_status(path) -> str:
    try:
        with RunFile(path) as run:
            return liveness.seen_status(run.status, run.attrs.get("writer"))
    except (OSError, UsageError):
        return "unreadable"


def objectives(study: Study, path) -> list[float]:
    """The trial's objective values, read from its results file."""
    run = Run(path)
    values = []
    for name in study.objectives:
        head, _, target = name.partition(":")
        if head == "rounds_to":
            hit = metrics.rounds_to(run, float(target))
            values.append(math.inf if hit is None else float(hit))
        else:
            values.append({
                "final_acc": lambda: metrics.final_accuracy(run),
                "ema_acc": lambda: metrics.final_accuracy(run, smooth=0.9),
                "best_acc": lambda: metrics.best_accuracy(run),
                "total_mb": lambda: metrics.total_traffic_mb(run),
                "up_mb": lambda: metrics.upload_mb(run),
                "virtual_hours": lambda: metrics.virtual_hours(run),
            }[head]())
    return values


class Judge:
    """The pruner's hands inside the run (rank 0): report each evaluated round's accuracy
    to the trial, and ask whether to stop."""

    def __init__(self, study: Study, store, claim_: Claim):
        optuna = optuna_module()
        target = optuna_study(study, study.method(claim_.method), store)
        self.trial = optuna.trial.Trial(target, claim_.trial_id)
        self.pruning = study.pruner != "none"
        # a resumed trial's rounds before its checkpoint were reported by its first run
        self.reported = set(store.get_trial(claim_.trial_id).intermediate_values)

    def __call__(self, round_: int, accuracy: float) -> bool:
        if not self.pruning:
            return False
        if round_ not in self.reported:
            self.trial.report(accuracy, round_)
            self.reported.add(round_)
        return self.trial.should_prune()


def tell(study: Study, store, claim_: Claim) -> str:
    """Rank 0, after the trial's run: Optuna learns the outcome; returns it."""
    optuna = optuna_module()
    target = optuna_study(study, study.method(claim_.method), store)
    state = optuna.trial.TrialState
    status = file_status(claim_.output)
    store.set_trial_user_attr(claim_.trial_id, "status", status)
    if status == "pruned":
        target.tell(claim_.number, state=state.PRUNED)
        return "pruned"
    values = objectives(study, claim_.output)
    if any(math.isnan(v) for v in values):
        target.tell(claim_.number, state=state.FAIL)
        return "failed (an objective is NaN: nothing evaluated)"
    target.tell(claim_.number, values if len(values) > 1 else values[0])
    shown = ", ".join(f"{o} {v:.4g}" for o, v in zip(study.objectives, values))
    return f"{'diverged; ' if status == 'failed' else ''}{shown}"


def fail(study: Study, store, claim_: Claim, exc: BaseException) -> None:
    optuna = optuna_module()
    target = optuna_study(study, study.method(claim_.method), store)
    try:
        store.set_trial_user_attr(claim_.trial_id, "error", f"{type(exc).__name__}: {exc}"[:500])
        target.tell(claim_.number, state=optuna.trial.TrialState.FAIL)
    except Exception as again:   # the study's file is the problem: the run's error matters more
        warn(f"fedmpi tune: could not mark trial {claim_.number} failed: {again}")

