"""Tuning studies (fedmpi.tune, `fedmpi tune`) on a real Optuna journal: the study file's
refusals, a TPE study whose median pruner stops a learning rate that does not learn,
two workers at once on one journal, a killed trial resumed bitwise, a multi-objective
study's Pareto front, and a study under mpirun equal to one process's."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import fedmpi, mpirun, needs_mpi
from fedmpi import tune as tunes
from fedmpi.errors import UsageError
from fedmpi.results import open_run
from helpers import TINY, write_config

optuna = pytest.importorskip("optuna")

STUDY = """
config = "base.toml"
outdir = "out"
trials = {trials}
objective = {objective}
pruner = "{pruner}"
pruner_startup = 1
sampler_startup = 3
seed = 4

[space]
"train.lr" = {space}
"""


# real digits that a 2NN learns within a round (0.05 s a round on one thread)
LEARNS = {**TINY, "data": {"dataset": "mnist5k"}, "model": {"name": "2nn"},
          "clients": {"num": 10, "per_round": 3}, "train": {"lr": 0.1, "batch_size": 32},
          "eval": {"every": 1, "batch_size": 500}}


def write_study(tmp_path: Path, trials=4, objective='"final_acc"', pruner="median",
                space="[0.1, 1e-7]", extra="", rounds=4, system=None, **config) -> Path:
    system = {"device": "cpu", "threads": 1, **(system or {})}
    write_config(tmp_path / "base.toml", LEARNS, rounds=rounds, system=system, **config)
    path = tmp_path / "study.toml"
    path.write_text(STUDY.format(trials=trials, objective=objective, pruner=pruner,
                                 space=space) + extra)
    return path


def trials_of(tmp_path: Path, name="study", method="base"):
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(tmp_path / "out" / name / "study.journal")))
    return optuna.load_study(study_name=f"{name}.{method}", storage=storage).get_trials()


def tune(tmp_path, *args, timeout=300):
    return fedmpi(["tune", "study.toml", *args], cwd=tmp_path, timeout=timeout)


# ---- refusals: one line, exit 2, before any trial ----------------------------------------

@pytest.mark.parametrize("change, says", [
    ({"space": "{low = 0.5, high = 0.1}"}, "needs finite low <= high"),
    ({"space": "{low = 0.0, high = 0.1, log = true}"}, "log = true needs low > 0"),
    ({"space": "[]"}, "choices must be a non-empty list"),
    ({"space": "{low = 0.1, high = 0.2, spread = 1}"}, "unknown key(s) spread"),
    ({"space": "{low = 0.1, high = inf}"}, "needs finite low <= high"),
    ({"objective": '"accuracy"'}, "objective 'accuracy' is unknown"),
    ({"objective": '"rounds_to"'}, "only rounds_to takes a target, and it needs one"),
    ({"objective": '"rounds_to:1.5"'}, "the target must be an accuracy in (0, 1]"),
    ({"objective": '["final_acc", "up_mb"]'}, "needs a single objective"),
    ({"trials": 0}, "trials must be an integer in 1..10000"),
    ({"pruner": "bogus"}, "pruner must be one of none, median"),
    ({"extra": '"model.bogus_field" = [1, 2]'}, "model.bogus_field"),
    ({"extra": '"train.lr" = [0.2]'}, "train.lr both searched and set (or searched twice)"),
])
def test_bad_studies_are_refused_in_one_line(tmp_path, change, says):
    extra = change.pop("extra", "")
    if "train.lr" in extra:
        extra = extra.replace('"train.lr" = [0.2]', '[set]\n"train.lr" = 0.2')
    path = write_study(tmp_path, **change, extra=extra)
    proc = tune(tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "out").exists()   # nothing started, nothing written
    with pytest.raises(UsageError):
        tunes.load(path)


def test_an_empty_space_and_a_pruner_with_nothing_to_read_are_refused(tmp_path):
    path = write_study(tmp_path)
    text = path.read_text()
    path.write_text(text.split("[space]")[0])
    proc = tune(tmp_path)
    assert proc.returncode == 2 and "method base has an empty search space" in proc.stderr
    path.write_text(text)
    write_study(tmp_path, eval={"every": 4})
    proc = tune(tmp_path)
    assert proc.returncode == 2 and "eval.every = 4 with rounds = 4 leaves none" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_dimensions_are_typed_from_their_bounds(tmp_path):
    path = write_study(tmp_path, space="{low = 0.01, high = 0.3, log = true}", extra=(
        '"train.local_epochs" = {low = 1, high = 3}\n"train.batch_size" = [8, 16]\n'))
    kinds = {d.key: (d.kind, d.log) for d in tunes.load(path).methods[0].space}
    assert kinds == {"train.lr": ("float", True), "train.local_epochs": ("int", False),
                     "train.batch_size": ("choice", False)}


# ---- a real study ------------------------------------------------------------------------

@pytest.mark.slow
def test_tpe_study_prunes_a_learning_rate_that_does_not_learn(tmp_path):
    write_study(tmp_path, trials=6, rounds=6)
    proc = tune(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trials = trials_of(tmp_path)
    assert len(trials) == 6 and len({t.number for t in trials}) == 6
    states = {t.number: (t.params["train.lr"], t.state.name) for t in trials}
    first_good = min(n for n, (lr, s) in states.items() if lr == 0.1)
    pruned = [n for n, (lr, s) in states.items() if s == "PRUNED"]
    # the median pruner (one trial to the end first) stops every 1e-7 trial once a 0.1
    # trial has finished, and never a 0.1 one
    assert pruned and all(states[n][0] == 1e-7 for n in pruned)
    assert all(s == "PRUNED" for n, (lr, s) in states.items() if lr == 1e-7 and n > first_good)
    for number in pruned:
        output = tmp_path / f"out/study/base/trial-{number:04d}.h5"
        with open_run(output) as run:
            assert run.status == "pruned" and run.attrs["pruned_round"] < 6
            assert int(run.rounds()["round"][-1]) == run.attrs["pruned_round"]
        again = fedmpi(["run", "--resume", output], cwd=tmp_path)
        assert again.returncode == 0 and "nothing to resume" in again.stdout
    for trial in trials:
        if trial.state.name == "COMPLETE":
            with open_run(tmp_path / trial.user_attrs["output"]) as run:
                acc = run.rounds()["test_acc"]
                assert trial.value == float(acc[np.isfinite(acc)][-1])
    best = tune(tmp_path, "--best")
    assert best.returncode == 0
    assert "every method has had the same budget: 6 trials each" in best.stdout
    assert "best: trial" in best.stdout and "train.lr=0.1" in best.stdout


@pytest.mark.slow
def test_two_workers_on_one_journal_run_the_budget_once(tmp_path):
    write_study(tmp_path, trials=6, pruner="none", space="{low = 0.01, high = 0.2}", rounds=2)
    procs = [subprocess.Popen([sys.executable, "-m", "fedmpi", "tune", "study.toml", "-q"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    trials = trials_of(tmp_path)
    assert sorted(t.number for t in trials) == list(range(6))
    assert all(t.state.name == "COMPLETE" for t in trials)
    outputs = {t.user_attrs["output"] for t in trials}
    assert len(outputs) == 6 and len({t.params["train.lr"] for t in trials}) == 6
    for output in outputs:
        with open_run(tmp_path / output) as run:
            assert run.status == "completed"
            assert "resumes" not in run.attrs   # nobody ran a trial twice


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_trial_resumes_and_ends_as_an_uninterrupted_run(tmp_path, sig):
    """SIGTERM: the trial checkpoints and its worker exits 75; SIGKILL: the worker dies
    mid-round, its file says running with a dead writer (crashed). Either way the next
    worker takes the trial back and it ends as the uninterrupted run."""
    write_study(tmp_path, trials=1, pruner="none", space="[0.05]", rounds=30,
                system={"deterministic": True, "checkpoint_every": 1})
    output = tmp_path / "out/study/base/trial-0000.h5"
    proc = subprocess.Popen([sys.executable, "-m", "fedmpi", "tune", "study.toml", "-q"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            with open_run(output) as run:
                if (run.rounds()["round"] >= 1).sum() >= 1:
                    break
        except (UsageError, OSError):
            pass
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == (75 if sig == signal.SIGTERM else -signal.SIGKILL), err
    with open_run(output) as run:
        assert run.status == ("interrupted" if sig == signal.SIGTERM else "running")
    assert [t.state.name for t in trials_of(tmp_path)] == ["RUNNING"]
    resumed = tune(tmp_path)
    assert resumed.returncode == 0 and "trial base/0 (train.lr=0.05): resuming" in resumed.stdout
    [trial] = trials_of(tmp_path)
    assert trial.state.name == "COMPLETE"
    plain = tmp_path / "plain.h5"
    fedmpi(["run", "base.toml", "--set", "train.lr=0.05", "-o", plain], cwd=tmp_path, check=True)
    with open_run(output) as a, open_run(plain) as b:
        assert a.status == "completed" and len(a.attrs["resumes"]) == 1
        assert np.array_equal(a.model(), b.model())
        assert np.array_equal(a.rounds()["test_acc"], b.rounds()["test_acc"], equal_nan=True)


@pytest.mark.slow
def test_a_multi_objective_study_gives_its_pareto_front(tmp_path):
    write_study(tmp_path, trials=6, objective='["final_acc", "up_mb"]', pruner="none",
                space="{low = 0.02, high = 0.2, log = true}", rounds=2,
                extra='"compression.up" = ["none", "fp16", "qsgd"]\n')
    proc = tune(tmp_path, "-q")
    assert proc.returncode == 0, proc.stderr
    trials = trials_of(tmp_path)
    points = {t.number: (t.values[0], t.values[1]) for t in trials}
    for trial in trials:   # the values are the files' own
        with open_run(tmp_path / trial.user_attrs["output"]) as run:
            rows = run.rounds()
            acc = rows["test_acc"][np.isfinite(rows["test_acc"])]
            assert points[trial.number] == (float(acc[-1]), float(np.nansum(rows["fl_bytes_up"])) / 1e6)
    front = {n for n, (a, mb) in points.items()
             if not any(a2 >= a and mb2 <= mb and (a2, mb2) != (a, mb) for a2, mb2 in points.values())}
    best = tune(tmp_path, "--best")
    assert f"Pareto front ({len(front)} of 6 completed trials)" in best.stdout
    shown = {int(line.split("trial ")[1].split(":")[0]) for line in best.stdout.splitlines()
             if line.strip().startswith("trial ")}
    assert shown == front


@pytest.mark.slow
@needs_mpi
def test_a_study_under_mpirun_is_the_single_process_study(tmp_path):
    """Six trials in one 3-rank job (the dataset windows freed between them), the median
    pruner on: every trial's parameters, state, rounds and final model (a pruned one: its
    pruned round) as one process's study gives them; a pruned trial stops every rank."""
    write_study(tmp_path, trials=6, rounds=6, system={"deterministic": True})
    one = tune(tmp_path, "-q", "--outdir", "one")
    assert one.returncode == 0, one.stderr
    three = mpirun(3, [sys.executable, "-m", "fedmpi", "tune", str(tmp_path / "study.toml"),
                       "-q", "--outdir", str(tmp_path / "three")], timeout=300)
    assert three.returncode == 0, three.stderr
    states = []
    for number in range(6):
        a = tmp_path / f"one/study/base/trial-{number:04d}.h5"
        b = tmp_path / f"three/study/base/trial-{number:04d}.h5"
        with open_run(a) as x, open_run(b) as y:
            assert y.attrs["world_size"] == 3
            assert x.config["train"]["lr"] == y.config["train"]["lr"]
            assert x.status == y.status and x.attrs.get("pruned_round") == y.attrs.get("pruned_round")
            assert np.array_equal(x.rounds()["test_acc"], y.rounds()["test_acc"], equal_nan=True)
            if x.status == "completed":
                assert np.array_equal(x.model(), y.model())
            states.append(x.status)
    assert "pruned" in states and "completed" in states


@pytest.mark.slow
def test_a_point_the_config_refuses_is_a_failed_trial_and_the_study_goes_on(tmp_path):
    """Only the lowest point of the space is checked before the study; another point may
    be one the config refuses (a negative rate here, a codec parameter without its codec
    in practice): that trial fails with the config's one line, the next one runs."""
    write_study(tmp_path, trials=5, pruner="none", space="[0.1, -1.0]", rounds=1)
    proc = tune(tmp_path)
    assert proc.returncode == 0, proc.stderr
    trials = trials_of(tmp_path)
    bad = [t for t in trials if t.params["train.lr"] == -1.0]
    assert bad and len(trials) == 5
    for trial in trials:
        assert trial.state.name == ("FAIL" if trial in bad else "COMPLETE")
    assert all("train.lr" in t.user_attrs["error"] for t in bad)
    assert proc.stderr.count("refused, marked failed") == len(bad)
    assert not any((tmp_path / t.user_attrs["output"]).exists() for t in bad)


@pytest.mark.slow
@needs_mpi
def test_the_array_template_runs_a_worker_of_the_study(tmp_path):
    """jobs/slurm/array_tune.sbatch as SLURM would run it (FEDMPI_LAUNCHER=mpirun): its
    one worker spends the budget; a second task finds nothing left and exits 0."""
    import os
    from conftest import ROOT
    write_study(tmp_path, trials=2, pruner="none", space="{low = 0.02, high = 0.2}", rounds=1)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "SLURM_ARRAY_TASK_ID": "0", "SLURM_NTASKS": "2",
           "FEDMPI_LAUNCHER": "mpirun", "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    template = str(ROOT / "jobs/slurm/array_tune.sbatch")
    for task in ("0", "1"):
        proc = subprocess.run(["bash", template, "study.toml", "-q"], cwd=tmp_path, text=True,
                              capture_output=True, timeout=300,
                              env={**env, "SLURM_ARRAY_TASK_ID": task})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "mpirun, 2 ranks, a worker of study study.toml" in proc.stdout
    trials = trials_of(tmp_path)
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    with open_run(tmp_path / trials[0].user_attrs["output"]) as run:
        assert run.attrs["world_size"] == 2


@pytest.mark.slow
def test_a_journal_cut_mid_line_loses_that_line_and_a_damaged_one_is_refused(tmp_path):
    """A worker killed while appending leaves a partial last line: it is dropped (one
    warning) before anything is appended after it, and the study goes on. A line of
    garbage inside the journal is one line, exit 2."""
    write_study(tmp_path, trials=2, pruner="none", space="{low = 0.02, high = 0.2}", rounds=1)
    assert tune(tmp_path, "-q").returncode == 0
    journal = tmp_path / "out/study/study.journal"
    whole = journal.read_bytes()
    partial = b'{"op_code": 5, "worker_id": "x", "trial_id": 1, "us'
    journal.write_bytes(whole + partial)
    (tmp_path / "study.toml").write_text((tmp_path / "study.toml").read_text()
                                         .replace("trials = 2", "trials = 3"))
    proc = tune(tmp_path, "-q")
    assert proc.returncode == 0, proc.stderr
    assert f"dropped its cut-short last line ({len(partial)} bytes" in proc.stderr
    assert journal.read_bytes().startswith(whole) and journal.read_bytes().endswith(b"\n")
    assert [t.state.name for t in trials_of(tmp_path)] == ["COMPLETE"] * 3
    with open(journal, "ab") as f:
        f.write(bytes(range(128, 256)) + b"\n")
    proc = tune(tmp_path, "--status")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert f"study journal {journal} is damaged" in proc.stderr


@pytest.mark.slow
def test_a_trial_whose_worker_died_before_telling_is_told_from_its_file(tmp_path, monkeypatch):
    """The run completed, the worker died before Optuna heard: the next claim reads the
    objective from the file (once the file is a minute old) instead of running it again."""
    import os
    from fedmpi import tune_worker as worker
    monkeypatch.chdir(tmp_path)
    write_study(tmp_path, trials=2, pruner="none", space="{low = 0.02, high = 0.2}", rounds=1)
    study = tunes.load("study.toml")
    store = worker.storage(study)
    claim = worker.claim(study, store)
    fedmpi(["run", "base.toml", "--set", f"train.lr={claim.params['train.lr']!r}",
            "-o", claim.output], check=True)
    old = time.time() - 2 * worker.UNTOLD
    os.utime(claim.output, (old, old))
    [trial] = trials_of(tmp_path)
    assert trial.state.name == "RUNNING"
    store.set_trial_user_attr(claim.trial_id, "claimed", old - 1)   # claimed before its run
    nxt = worker.claim(study, store)
    assert nxt.number == 1 and not nxt.resume
    told = trials_of(tmp_path)[0]
    with open_run(claim.output) as run:
        acc = run.rounds()["test_acc"]
    assert told.state.name == "COMPLETE" and told.value == float(acc[np.isfinite(acc)][-1])
