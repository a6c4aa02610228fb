"""fedmpi from Python: ``fedmpi.run(...)`` starts an experiment in this process, as
``fedmpi run`` does on one rank, for a notebook or a script that drives runs itself.

It resolves the config as the command line does (a TOML file, a dict of the same shape, or
a preset, then ``overrides``), makes the same checks before anything is written (the
dataset is there, the results file is free), and raises what the command line would
print: ``UsageError`` (bad input, exit 2 there), ``RunDiverged`` (exit 1), ``Preempted``
(a SIGTERM/SIGUSR1 checkpointed the run, exit 75). It returns the results file's path,
for ``fedmpi.analysis``. Runs over several ranks are launched with ``mpirun fedmpi run``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

from .errors import UsageError, warn

# deferred imports: ``import fedmpi`` loads this module, and the functions import what
# they use (the config's checks, the results file: h5py; the runtime: torch) when called.


class RunDiverged(RuntimeError):
    """The run's loss went non-finite; its rounds so far are in ``path``."""

    def __init__(self, path: Path):
        super().__init__(f"run diverged; results so far in {path}")
        self.path = path


class Preempted(RuntimeError):
    """A preemption signal checkpointed the run; ``fedmpi.run(resume=path)`` continues it."""

    def __init__(self, path: Path):
        super().__init__(f"run checkpointed on a preemption signal; continue it with "
                         f"fedmpi.run(resume={str(path)!r})")
        self.path = path


def run(config: str | os.PathLike | Mapping | None = None, *, preset: str | None = None,
        overrides: Mapping | Sequence[str] = (), output: str | os.PathLike | None = None,
        force: bool = False, resume: str | os.PathLike | None = None,
        quiet: bool = True) -> Path:
    """Run one experiment in this process and return its results file.

    ``config``: a TOML file's path, or its contents as a dict (``{"rounds": 5, "train":
    {"lr": 0.05}}``); or ``preset`` (default ``"default"``). ``overrides``: ``--set`` values,
    as ``{"train.lr": 0.1}`` or ``["train.lr=0.1"]``. ``output``: the results file (default
    the config's ``output``). ``force`` overwrites an existing file; ``resume`` continues
    the run in that file from its checkpoint (then give nothing else). ``quiet=False``
    prints a line per round."""
    from .comm import LocalComm
    from .config import resolve, toml_value
    from .runtime import run_experiment

    if resume is not None:
        if config is not None or preset or overrides or output is not None or force:
            raise UsageError("resume= takes the config from the file: give nothing else")
        config_, back = resume_config(resume)
        if config_ is None:   # completed already: nothing to do
            return Path(resume)
    else:
        lines = _override_lines(overrides)
        if output is not None:
            lines.append(f"output={toml_value(str(output))}")
        if isinstance(config, Mapping):
            config_ = resolve(None, preset, lines, values=dict(config))
        else:
            config_ = resolve(None if config is None else os.fspath(config), preset, lines)
        prepare(config_, force)
        back = None
    path = config_.output_path()
    try:
        experiment = run_experiment(config_, LocalComm(), force=force, quiet=quiet,
                                    resume=resume is not None)
    finally:
        if back is not None:   # the caller's directory, as it was
            os.chdir(back)
    if experiment.preempted:
        raise Preempted(path)
    if experiment.diverged:
        raise RunDiverged(path)
    return path


def _override_lines(overrides) -> list[str]:
    from .config import toml_value

    if isinstance(overrides, str):
        raise UsageError(f"overrides={overrides!r}: give a dict {{'train.lr': 0.1}} or a list "
                         f"of 'KEY=VALUE' strings")
    if isinstance(overrides, Mapping):
        return [f"{key}={toml_value(value)}" for key, value in overrides.items()]
    return [str(line) for line in overrides]


def prepare(config, force: bool) -> None:
    """Before a new run claims its results file: the data are there (in the dataset
    loader's words if not) and the file is free. Both ``fedmpi run`` and ``fedmpi.run``."""
    from .data import check_present

    check_present(config.data.dataset, config.data.data_dir, config.seed, **config.data.options)
    check_output(config.output_path(), force)


def check_output(path, force: bool) -> None:
    """A new run's results file: never a directory, never a live run's file, an existing
    one only with --force, and a directory it can be written in; before any MPI work."""
    if path.is_dir():
        raise UsageError(f"results file {path} is a directory; give a file path such as "
                         f"{path / 'run.h5'} with -o/--output")
    from .results.writer import refuse_foreign

    refuse_foreign(path)   # not a results file: never overwritten, --force or not
    if path.exists() and not force:
        raise UsageError(f"results file {path} exists; pass --force to overwrite it, "
                         f"--resume {path} to continue it, or choose another with -o/--output")
    refuse_live_writer(path)
    parent = Path(path).absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"results file {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"results file {path}: cannot write in {parent} (permission denied "
                         f"or a read-only file system); choose another with -o/--output")


def refuse_live_writer(path) -> None:
    from .results import lock

    holder = lock.holder(path)
    if holder is not None:
        raise UsageError(lock.busy_message(path, holder))


def resume_config(path, speak: bool = True):
    """(the config of the run in ``path``, writing to ``path``; the directory to return
    to) or (None, None) if the run completed. The run's relative paths (data.path,
    state_dir, ...) point from where it started: the process moves there, before the config
    is validated (its data files are looked at), and the caller may move back after."""
    from .config import from_dict
    from .config.since import as_started
    from .results import RunFile, liveness
    from .results.recovery import damaged

    if Path(path).is_dir():
        raise UsageError(f"--resume {path}: is a directory; give the run's results file (.h5)")
    if Path(path).is_file():
        refuse_live_writer(path)
        if speak:   # the other ranks exit 2 quietly, as with every usage error
            problem = damaged(path)
            if problem:
                raise UsageError(problem)
    with RunFile(path) as run:
        status, values, writer = run.status, run.config, run.attrs.get("writer")
        start = run.start_dir
    if status == "running" and liveness.state(writer) == liveness.ALIVE:
        from .results.lock import busy_message
        raise UsageError(busy_message(path, writer))
    if status in ("completed", "pruned"):   # a pruned trial ended as its study decided
        return None, None
    back = None
    if start is not None and not start.samefile("."):
        path, back = os.path.abspath(path), os.getcwd()
        os.chdir(start)
    try:
        values["output"] = str(path).replace("{", "{{").replace("}", "}}")
        for line in as_started(values):
            if speak:
                warn(f"fedmpi: {path}: {line}")
        return from_dict(values), back
    except BaseException:
        if back is not None:
            os.chdir(back)
        raise
