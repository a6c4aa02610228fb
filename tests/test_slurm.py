"""The SLURM job templates, submitted to a real single-node SLURM on this machine.

The cluster (tests/slurm.py) is installed if needed and started once per session; the
jobs are tiny configs of 1 server + 1 or 2 workers on CPU. Each template is submitted
with the options the README gives for CPU-only use (``--gres=none``); the default
launcher is ``srun --mpi=pmix``, and the array test uses ``FEDMPI_LAUNCHER=mpirun`` so
that both launch paths run for real.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, needs_mpi
from fedmpi import sweep as sweeps
from fedmpi.errors import UsageError
from fedmpi.results import open_run
from helpers import write_config
from slurm import TERMINAL, LocalSlurm, SlurmUnavailable, ensure_installed

TEMPLATES = sorted((ROOT / "jobs/slurm").glob("*.sbatch"))
BLOCK = re.compile(r"^# ==== fedmpi job block.*?^# ==== end of the fedmpi job block ====$", re.S | re.M)
CPU = ["--gres=none", "--cpus-per-task=1"]


@pytest.fixture(scope="session")
def cluster():
    try:
        ensure_installed()
        local = LocalSlurm().start()
    except SlurmUnavailable as exc:
        pytest.skip(f"no local SLURM cluster: {exc}")
    yield local
    local.stop()


@pytest.fixture(scope="session")
def launcher(cluster):
    """srun (the templates' default) when srun --mpi=pmix works here, else mpirun."""
    reason = cluster.pmix_works()
    if reason:
        print(f"srun --mpi=pmix does not work here ({reason}); jobs use FEDMPI_LAUNCHER=mpirun")
    return "mpirun" if reason else "srun"


def submit(cluster, template: str, args: list[str], tmp_path: Path, sbatch_options=(),
           launcher: str = "srun") -> str:
    """sbatch a template from tmp_path with this checkout's fedmpi on PATH."""
    env = cluster.env({
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),   # jobs import the fedmpi under test
        "FEDMPI_LAUNCHER": launcher,
    })
    log = "%x-%A_%a.log" if any(o.startswith("--array") for o in sbatch_options) else "%x-%j.log"
    return cluster.sbatch([f"--chdir={tmp_path}", f"--output={tmp_path / log}", *CPU,
                           *sbatch_options, str(ROOT / "jobs/slurm" / template), *args], env=env)


def finished(cluster, job: str, tmp_path: Path, timeout: float = 240) -> list[dict]:
    """Wait for the job; on failure say what its logs say."""
    try:
        jobs = cluster.wait(job, timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{logs(tmp_path)}") from None
    bad = [j for j in jobs if j["JobState"] != "COMPLETED" or j["ExitCode"] != "0:0"]
    assert not bad, f"{[(j['JobId'], j['JobState'], j['ExitCode']) for j in bad]}\n{logs(tmp_path)}"
    return jobs


def _json(value):
    """Provenance lists are stored as JSON text (parsed already by newer readers)."""
    return json.loads(value) if isinstance(value, str) else value


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(tmp_path.glob("*.log")))


# ---- no cluster needed ------------------------------------------------------------------

def test_templates_share_one_job_block_and_parse():
    assert {p.name for p in TEMPLATES} >= {"single_node.sbatch", "multi_node.sbatch",
                                           "array_sweep.sbatch"}
    blocks = {p.name: BLOCK.search(p.read_text()) for p in TEMPLATES}
    assert all(blocks.values()), [name for name, b in blocks.items() if not b]
    assert len({b.group(0) for b in blocks.values()}) == 1, "the job blocks differ: copy one to the others"
    for path in TEMPLATES:
        text = path.read_text()
        assert "#SBATCH --signal=B:USR1@" in text and "#SBATCH --requeue" in text, path.name
        subprocess.run(["bash", "-n", str(path)], check=True)


@needs_mpi
@pytest.mark.slow
def test_templates_refuse_numbers_in_the_environment_that_are_not_numbers(tmp_path):
    """Bash arithmetic read FEDMPI_CELL_OFFSET=1,000 and =abc as 0 and =01000 as octal 512:
    the task silently ran another cell. FEDMPI_WORKERS_PER_NODE=abc (or 0, or
    --ntasks-per-node=1) ran the whole job on one rank; FEDMPI_CELL=x was one error per
    rank. The templates run directly here, as the batch script SLURM would run, under
    mpirun, as FEDMPI_LAUNCHER=mpirun has it."""
    write_config(tmp_path / "base.toml", rounds=1)
    (tmp_path / "s.toml").write_text('name = "g"\nconfig = "base.toml"\n[grid]\nseed = [0, 1]\n')
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "SLURM_ARRAY_TASK_ID": "1", "SLURM_NTASKS": "1",
           "FEDMPI_LAUNCHER": "mpirun", "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    template = str(ROOT / "jobs/slurm/array_sweep.sbatch")
    for offset in ("abc", "1,000", "-1", "1 0"):
        proc = subprocess.run(["bash", template, "s.toml"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60, env={**env, "FEDMPI_CELL_OFFSET": offset})
        assert proc.returncode == 2 and proc.stdout == "" and proc.stderr == (
            f"fedmpi: FEDMPI_CELL_OFFSET={offset}: must be a whole number >= 0 (task i runs "
            f"cell offset + i)\n"), proc.stderr
    proc = subprocess.run(["bash", template, "s.toml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**env, "FEDMPI_CELL_OFFSET": "0100"})
    assert "mpirun, 1 ranks, cell 101 of s.toml" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 2 and "no cell 101; it has 2 cell(s), 0..1" in proc.stderr
    for template, variables, says in (
            ("single_node", {"FEDMPI_CELL": "x"}, "FEDMPI_CELL=x: must be a whole number >= 0 (the sweep's cell)"),
            ("multi_node", {"FEDMPI_WORKERS_PER_NODE": "abc"},
             "FEDMPI_WORKERS_PER_NODE=abc: must be a whole number >= 1 (workers per node)"),
            ("multi_node", {"FEDMPI_WORKERS_PER_NODE": "0"}, "FEDMPI_WORKERS_PER_NODE=0: must be"),
            ("multi_node", {"SLURM_NTASKS_PER_NODE": "1"},
             "--ntasks-per-node=1 leaves no worker beside the server; give G + 1 for G workers per node")):
        proc = subprocess.run(["bash", str(ROOT / f"jobs/slurm/{template}.sbatch"), "base.toml"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60,
                              env={**env, **variables})
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        assert proc.stderr.startswith(f"fedmpi: {says}") and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "runs").exists() and not list(tmp_path.glob("*.h5"))


# ---- against the local cluster ----------------------------------------------------------

@pytest.mark.slow
def test_clusters_side_by_side_number_their_jobs_apart_and_both_launch(cluster, launcher):
    """CI: each pytest-xdist worker runs a cluster of its own, and two clusters that both
    ran job 2 at once collided in the PMIx plugin's directories (named by job and step id
    alone): the second srun step failed with "task 0 launch failed: Unspecified error".
    Two more clusters here, fresh (each would start at job 1 were it not for its block of
    job ids), launch 3-rank steps at the same moment."""
    from concurrent.futures import ThreadPoolExecutor

    mpi = ["--mpi=pmix"] if launcher == "srun" else []
    step = ["srun", *mpi, "-n", "3", "bash", "-c", "echo $SLURM_JOB_ID; sleep 1"]
    with LocalSlurm() as a, LocalSlurm() as b:
        ranges = [tuple(int(re.search(rf"^{key}=(\d+)$", c.conf.read_text(), re.M).group(1))
                        for key in ("FirstJobId", "MaxJobId")) for c in (cluster, a, b)]
        assert all(hi < lo2 or hi2 < lo for i, (lo, hi) in enumerate(ranges)
                   for (lo2, hi2) in ranges[i + 1:]), ranges
        with ThreadPoolExecutor(2) as pool:
            procs = list(pool.map(lambda c: c.client(step, check=False), (a, b)))
    for proc, (lo, hi) in zip(procs, ranges[1:]):
        ids = proc.stdout.split()
        assert len(ids) == 3 and len(set(ids)) == 1 and lo <= int(ids[0]) <= hi, proc.stdout + proc.stderr
        assert "launch failed" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_single_node_template_runs_a_config(cluster, launcher, tmp_path):
    config = write_config(tmp_path / "tiny.toml", rounds=3, output="runs/tiny.h5")
    job = submit(cluster, "single_node.sbatch", [config.name], tmp_path, ["--ntasks=3"], launcher)
    finished(cluster, job, tmp_path)
    with open_run(tmp_path / "runs/tiny.h5") as run:
        assert run.status == "completed" and run.attrs["world_size"] == 3
        assert run.rounds()["round"].tolist() == [0, 1, 2, 3]   # 0: the initial model
        assert [r["device"] for r in _json(run.attrs["ranks"])] == ["cpu"] * 3
    assert f"{launcher}, 3 ranks, cell 0 of tiny.toml" in logs(tmp_path)


@pytest.mark.slow
def test_multi_node_template_places_server_and_workers(cluster, launcher, tmp_path):
    """One node here: the hostfile placement still makes 1 + G ranks (G = per node - 1)."""
    config = write_config(tmp_path / "tiny.toml", rounds=2, output="multi.h5")
    job = submit(cluster, "multi_node.sbatch", [config.name], tmp_path,
                 ["--nodes=1", "--ntasks-per-node=3"], launcher)
    finished(cluster, job, tmp_path)
    with open_run(tmp_path / "multi.h5") as run:
        assert run.status == "completed" and run.attrs["world_size"] == 3
        assert _json(run.attrs["hostnames"]) == [cluster.node]


@pytest.mark.slow
def test_array_template_runs_every_cell_of_a_sweep(cluster, tmp_path):
    write_config(tmp_path / "base.toml", rounds=2)
    (tmp_path / "s.toml").write_text('name = "tiny"\nconfig = "base.toml"\n[grid]\n'
                                     '"algorithm.name" = ["fedavg", "fedprox"]\nseed = [0, 1]\n')
    plan = sweeps.load(tmp_path / "s.toml", outdir=str(tmp_path / "runs"))
    assert len(plan) == 4
    job = submit(cluster, "array_sweep.sbatch", ["s.toml", "--outdir", "runs"], tmp_path,
                 [f"--array=0-{len(plan) - 1}%2", "--ntasks=2"], launcher="mpirun")
    jobs = finished(cluster, job, tmp_path)
    assert sorted(int(j["ArrayTaskId"]) for j in jobs) == [0, 1, 2, 3]
    for cell in plan.cells:
        assert cell.output.name == f"{cell.name}.h5"   # e.g. algorithm.name=fedprox,seed=1.h5
        with open_run(cell.output) as run:
            assert run.status == "completed" and run.attrs["world_size"] == 2
            assert (run.config["algorithm"]["name"], run.config["seed"]) == tuple(v for _, v in cell.values)


@pytest.mark.slow
def test_preempted_job_checkpoints_requeues_and_completes(cluster, launcher, tmp_path):
    # the signal must land before the run ends: on a loaded 2-core machine (load 8, the
    # suite's four workers) 20 rounds of ~0.18 s ended before it did, the job COMPLETED
    rounds = 60
    config = write_config(tmp_path / "long.toml", rounds=rounds, output="long.h5")
    output = tmp_path / "long.h5"
    job = submit(cluster, "single_node.sbatch", [config.name], tmp_path, ["--ntasks=3"], launcher)
    _wait_for_first_round(cluster, job, output, tmp_path)
    # what SLURM does at --signal=B:USR1@120: USR1 to the batch shell only
    cluster.client(["scancel", "--signal=USR1", "--batch", job])
    (state,) = finished(cluster, job, tmp_path, timeout=300)
    assert int(state["Restarts"]) >= 1, logs(tmp_path)
    with open_run(output) as run:
        assert run.status == "completed"
        assert list(run.rounds()["round"]) == list(range(0, rounds + 1))
        resumed_from = [entry["round"] for entry in run.attrs["resumes"]]
        assert resumed_from and 1 <= resumed_from[0] < rounds  # continued from its checkpoint
        assert run.attrs["interrupted_round"] is None  # the stop's details end with the resume
    text = logs(tmp_path)
    assert "requeueing job" in text and "resuming (interrupted)" in text
    assert f"checkpointed after round {resumed_from[0]}" in text


@pytest.mark.slow
def test_preemption_with_grace_time_checkpoints_and_requeues(cluster, launcher, tmp_path):
    """A job in `urgent` preempts ours (PreemptMode=REQUEUE, GraceTime 60 s). SLURM sends
    TERM to the job's steps only and would requeue the job when the grace ends, but not
    once it has exited: the ranks checkpoint and exit 75 at once, and the template, seeing
    the job's PreemptTime, requeues it. (That a requeued job resumes and completes is the
    time-limit test's: the same requeue. Here the test resumes the file itself rather than
    wait out SLURM's hold on a requeued job.) Under FEDMPI_LAUNCHER=mpirun the ranks are in
    no step: TERM reaches nobody and the run goes on through the grace."""
    rounds = 200   # ~4 s: the preemption lands within ~2 s of the urgent job's submission
    config = write_config(tmp_path / "long.toml", rounds=rounds, output="long.h5",
                          system={"checkpoint_every": 5})
    output = tmp_path / "long.h5"
    job = submit(cluster, "single_node.sbatch", [config.name], tmp_path, ["--ntasks=3"], launcher)
    _wait_for_first_round(cluster, job, output, tmp_path)
    cluster.sbatch(["--partition=urgent", "--exclusive", *CPU[:1], f"--chdir={tmp_path}",
                    f"--output={tmp_path / 'urgent.out'}", "--wrap", "sleep 1"])
    if launcher != "srun":
        finished(cluster, job, tmp_path)
        return
    deadline = time.time() + 120
    while "requeueing job" not in logs(tmp_path) and time.time() < deadline and \
            cluster.jobs(job)[0]["JobState"] not in TERMINAL:   # ended unrequeued: fails below
        time.sleep(0.2)
    text = logs(tmp_path)
    assert "preempted, checkpointed (exit 75); requeueing job" in text, text
    while time.time() < deadline and cluster.jobs(job)[0]["JobState"] == "COMPLETING":
        time.sleep(0.2)   # the first run's clean-up, then the requeued job waits
    (state,) = cluster.jobs(job)
    assert int(state["Restarts"]) == 1 and state["JobState"] in ("PENDING", "REQUEUED"), state
    cluster.client(["scancel", job])   # no need to wait for SLURM's hold on it
    cluster.wait(job)
    with open_run(output) as run:
        done = run.checkpoint().round
        assert run.status == "interrupted" and run.attrs["interrupted_round"] == done
        assert f"checkpointed after round {done}" in text and 0 < done < rounds
    resumed = subprocess.run([sys.executable, "-m", "fedmpi", "run", "-q", "--resume", str(output)],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    with open_run(output) as run:
        assert run.status == "completed" and list(run.rounds()["round"]) == list(range(rounds + 1))


@pytest.mark.slow
def test_a_worker_killed_under_srun_ends_the_job_and_the_file_resumes(cluster, launcher, tmp_path):
    """The OOM killer takes a worker: the job ends (FAILED, not requeued) rather than hang
    its other ranks in a collective, and the file left running resumes to completion."""
    if launcher != "srun":
        pytest.skip("srun --mpi=pmix does not work here")
    rounds = 200
    config = write_config(tmp_path / "long.toml", rounds=rounds, output="long.h5",
                          system={"checkpoint_every": 5})
    output = tmp_path / "long.h5"
    job = submit(cluster, "single_node.sbatch", [config.name], tmp_path, ["--ntasks=3"], launcher)
    _wait_for_first_round(cluster, job, output, tmp_path)
    rank_2 = [pid for pid, env in _processes() if env.get("SLURM_JOB_ID") == job
              and env.get("SLURM_PROCID") == "2"]
    assert rank_2, logs(tmp_path)
    os.kill(min(rank_2), signal.SIGKILL)   # the rank itself, should it have a child
    killed = time.time()
    (state,) = cluster.wait(job, timeout=90)
    assert state["JobState"] == "FAILED" and int(state["Restarts"]) == 0, (state, logs(tmp_path))
    assert time.time() - killed < 45, logs(tmp_path)   # srun's --wait=30 at the latest
    assert "requeueing" not in logs(tmp_path)
    resumed = subprocess.run([sys.executable, "-m", "fedmpi", "run", "-q", "--resume", str(output)],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    with open_run(output) as run:
        assert run.status == "completed" and list(run.rounds()["round"]) == list(range(rounds + 1))


def _processes():
    """(pid, environment) of this machine's python processes that we may read."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"python" in (entry / "cmdline").read_bytes():
                pairs = (entry / "environ").read_bytes().split(b"\0")
                yield int(entry.name), dict(p.decode(errors="replace").partition("=")[::2]
                                            for p in pairs if p)
        except OSError:   # gone, or not ours
            pass


STAGGERED_RANK = """#!/usr/bin/env bash
# stands in for fedmpi's ranks: on TERM each exits 75 as fedmpi's do, rank 0 at once and
# the others {lag} s later, during which, like a rank tearing down, a second TERM kills it
trap 'trap - TERM; if [[ $SLURM_PROCID != 0 ]]; then sleep {lag}; fi; exit 75' TERM
echo "rank $SLURM_PROCID ready"
for _ in $(seq 600); do sleep 0.1; done   # a minute at most, should SLURM restart the job
"""


@pytest.mark.slow
def test_a_preempted_job_whose_ranks_exit_75_apart_still_requeues(cluster, launcher, tmp_path):
    """CI caught the real run's worker ending after rank 0's exit 75: srun's
    --kill-on-bad-exit=1 killed it, srun exited 143, and the preempted job was not
    requeued. Ranks that stop one after another must leave srun's 75 intact. fedmpi's
    ranks cannot be made to exit apart on purpose, so this job's ranks are a stand-in
    `fedmpi` that does exactly that (the template, srun and the preemption are real)."""
    if launcher != "srun":
        pytest.skip("srun --mpi=pmix does not work here")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "fedmpi").write_text(STAGGERED_RANK.format(lag=3))
    (bin_dir / "fedmpi").chmod(0o755)
    env = cluster.env({"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    job = cluster.sbatch([f"--chdir={tmp_path}", f"--output={tmp_path / '%x-%j.log'}", *CPU,
                          "--ntasks=3", str(ROOT / "jobs/slurm/single_node.sbatch"), "x.toml"],
                         env=env)
    deadline = time.time() + 120
    while logs(tmp_path).count("ready") < 3 and time.time() < deadline:
        time.sleep(0.2)
    cluster.sbatch(["--partition=urgent", "--exclusive", *CPU[:1], f"--chdir={tmp_path}",
                    f"--output={tmp_path / 'urgent.out'}", "--wrap", "sleep 1"])
    try:
        while "requeueing job" not in logs(tmp_path) and time.time() < deadline and \
                cluster.jobs(job)[0]["JobState"] not in TERMINAL:
            time.sleep(0.2)
        text = logs(tmp_path)
    finally:
        _cancel(cluster, job)
    assert text.count("ready") == 3, text
    assert not re.search(r"tasks? [0-9,-]+: (Terminated|Killed)", text), text   # srun let them exit
    assert "preempted, checkpointed (exit 75); requeueing job" in text, text


def _cancel(cluster, job: str, timeout: float = 120) -> None:
    """scancel a job for good: one that is COMPLETING (its run ending, a requeue next) is
    cancelled once it is pending again, not before (SLURM would start it anew)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cluster.jobs(job)[0]["JobState"] in TERMINAL:
            return
        if cluster.jobs(job)[0]["JobState"] != "COMPLETING":
            cluster.client(["scancel", job])
        time.sleep(0.5)
    raise AssertionError(f"job {job} not cancelled after {timeout} s: {cluster.jobs(job)}")


def _wait_for_first_round(cluster, job: str, output: Path, tmp_path: Path, timeout: float = 120):
    """Until the file has round 1, reading it every 0.1 s; the job's state (an scontrol
    call, slow on a loaded machine) once a second."""
    deadline, next_state = time.time() + timeout, time.time()
    while time.time() < deadline:
        if output.exists():
            try:
                with open_run(output) as run:
                    done = run.rounds()["round"]
                    if len(done) and done[-1] >= 1:   # round 1 trained (round 0 evaluates only)
                        return
            except (UsageError, OSError):   # still being created
                pass
        if time.time() >= next_state:
            states = {j.get("JobState") for j in cluster.jobs(job)}
            assert states & {"PENDING", "RUNNING", "CONFIGURING"}, f"job ended early: {states}\n{logs(tmp_path)}"
            next_state = time.time() + 1.0
        time.sleep(0.1)
    raise AssertionError(f"no round in {output} after {timeout} s\n{logs(tmp_path)}")


@pytest.mark.slow
def test_scancel_stops_the_run_at_a_round_boundary(cluster, launcher, tmp_path):
    """Plain `scancel` (TERM to the batch shell and every task, KILL after KillWait): srun
    hands TERM to the ranks, which checkpoint at the round boundary and exit 75; the job
    stays cancelled (no requeue) and the file resumes. Under FEDMPI_LAUNCHER=mpirun, mpirun
    gets TERM too and kills the ranks 0.25 s later: the file may then stay running, with a
    checkpoint at most checkpoint_every rounds old, and resumes all the same."""
    config = write_config(tmp_path / "long.toml", rounds=150, output="long.h5",
                          system={"checkpoint_every": 5})
    output = tmp_path / "long.h5"
    job = submit(cluster, "single_node.sbatch", [config.name], tmp_path, ["--ntasks=3"], launcher)
    _wait_for_first_round(cluster, job, output, tmp_path)
    time.sleep(1.0)
    cluster.client(["scancel", job])
    (state,) = cluster.wait(job, timeout=120)
    assert state["JobState"] == "CANCELLED", (state, logs(tmp_path))
    with open_run(output) as run:
        done = int(run.rounds()["round"][-1])   # rounds 0 (the initial model) .. done
        assert 0 < done < 150
        if launcher == "srun":
            assert run.status == "interrupted", logs(tmp_path)
            assert run.attrs["interrupted_round"] == done == run.checkpoint().round
        else:
            assert run.status in ("interrupted", "running")
            assert done - run.checkpoint().round <= 5
    resumed = subprocess.run([sys.executable, "-m", "fedmpi", "run", "-q", "--resume", str(output)],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    with open_run(output) as run:
        assert run.status == "completed" and list(run.rounds()["round"]) == list(range(0, 151))
