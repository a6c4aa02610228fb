"""Real ``fedmpi`` processes for the tests, without each one's interpreter start-up.

Most of the suite's CPU went into starting Python: ``import torch`` alone is 1.4 s of
CPU on this kind of machine, a tiny ``fedmpi run`` 2 s in all, and the suite starts a few
hundred of them. This module, run as a script, is a fork server (Android's zygote, or
multiprocessing's forkserver, whose children run a function and end by os._exit): it
imports torch and fedmpi once, and for each request forks a child that *is* ``python -m
MODULE ARGS`` from there on. The child takes the request's environment, working
directory, ``sys.argv`` and ``sys.path`` (the working directory first, then PYTHONPATH,
as ``-m`` has them), runs the module as ``__main__`` through runpy (as ``-m`` does), and
ends as that interpreter ends: exit codes, death by signal, atexit handlers and the
flushes of a normal ending are the real ones. What differs: the imports were done
already, and an ending by ``sys.exit`` skips the teardown of modules and C++ statics
(``end``: it cost more than most commands, and frees nothing a process's end does
not). Signals, kill -9 and timeouts reach the child as they reach any child process.

The server forks only while it runs no Python thread and has run no torch operation
(OpenMP's thread pool does not survive a fork; OpenBLAS's, which numpy starts on import,
stops and restarts itself around one); ``mpi4py.MPI`` (which initialises MPI on import) is
never imported in it. A request whose environment changes what an interpreter or a
native library reads at start-up (PYTHON* but PYTHONPATH, OMP_*, MKL_*, LD_*, ...) goes
to a fresh process instead (conftest.fedmpi), as does everything under
``FEDMPI_TESTS_FRESH=1``.

mpirun's ranks cost the same 2 s each, and the suite starts some 260 of them: with
``--ranks SOCKET`` this script is a second server, for them. ``conftest.mpirun`` starts
``tests/zygote_rank.py`` under mpirun in place of ``python``; that stub (no torch) hands
the rank's environment, arguments and descriptors 0-2 to the server, which forks the
rank from its imports; the stub passes on the signals mpirun sends it, ends as the rank
ends, and a stub killed outright takes its rank along (``become_rank``). MPI itself is
initialised in the rank, after the fork, from the rank's environment, as in a fresh one.
The kill and signal tests, which signal ranks by their pids, start theirs fresh.

Protocol (one JSON line each way, on the server's stdin and stdout): the client writes
``{"module", "args", "env", "cwd", "stdout", "stderr"}`` (the last two: files for the
child's descriptors 1 and 2); the server answers ``{"pid"}`` once the child exists and
``{"status"}`` (``os.waitstatus_to_exitcode``) once it has ended and been reaped.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

# Read by an interpreter or a native library when it starts: a request that changes one
# of these needs a fresh process (PYTHONPATH alone is applied by the child itself).
STARTUP_PREFIXES = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_",
                    "MALLOC_", "TORCH_", "PYTORCH_", "HDF5_", "LC_", "LANG")
# What fedmpi's commands import (matplotlib, which reads MPLBACKEND, is not among them).
PRELOAD = ("torch", "torchvision", "h5py", "numpy", "click", "fedmpi.cli", "fedmpi.results",
           "fedmpi.runtime.experiment", "fedmpi.algorithms", "fedmpi.models", "fedmpi.data",
           "fedmpi.analysis.cli", "fedmpi.sweep_cli")


def startup_differs(env: dict, reference: dict) -> bool:
    keys = set(env) | set(reference)
    return any(env.get(k) != reference.get(k) for k in keys
               if k.startswith(STARTUP_PREFIXES) and k != "PYTHONPATH")


def rank_startup_differs(env: dict, reference: dict) -> bool:
    """``startup_differs`` for a rank of mpirun, which puts its own library folder
    (OMPI_LIBDIR_LOC, where libmpi is) on LD_LIBRARY_PATH: only MPI loads from there,
    and it loads once the rank imports mpi4py.MPI, after the fork, the same library."""
    own = env.get("OMPI_LIBDIR_LOC")
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p != own]
    env = {k: v for k, v in env.items() if k != "LD_LIBRARY_PATH"}
    if paths:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(paths)
    return startup_differs(env, reference)


# ---- the client: one server per test process, started on first use ----------------------

class _Server:
    """``python zygote.py ARGS``, this test process's: ready once it has said so; it ends
    at the end of its input (``close``, at the latest as the test process exits)."""

    def __init__(self):
        self.env = dict(os.environ)
        self.files = tempfile.mkdtemp(prefix="fedmpi-zygote-")
        self.proc = subprocess.Popen([sys.executable, __file__, *self.arguments()],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=self.env)
        ready = self.proc.stdout.readline()
        if json.loads(ready or "null") != "ready":
            raise RuntimeError(f"the test zygote did not start: {ready!r}")
        atexit.register(self.close)

    def arguments(self) -> list[str]:
        return []

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self):
        self.proc.stdin.close()   # the server ends at the end of its input
        self.proc.wait()
        self.proc.stdout.close()
        shutil.rmtree(self.files, ignore_errors=True)


class Zygote(_Server):
    def __init__(self):
        self.lock = threading.Lock()
        super().__init__()

    def run(self, module: str, args: list[str], env: dict, cwd: str,
            timeout: float) -> subprocess.CompletedProcess:
        """``python -m MODULE ARGS`` as subprocess.run(capture_output=True, text=True)."""
        with self.lock:
            out, err = (os.path.join(self.files, name) for name in ("stdout", "stderr"))
            for path in (out, err):
                open(path, "wb").close()
            request = {"module": module, "args": args, "env": env, "cwd": cwd,
                       "stdout": out, "stderr": err}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self._answer()["pid"]
            timed_out = threading.Event()
            timer = threading.Timer(timeout, _kill, (pid, timed_out))
            timer.start()
            try:
                status = self._answer()["status"]
            finally:
                timer.cancel()
            cmd = [sys.executable, "-m", module, *args]
            if timed_out.is_set():
                raise subprocess.TimeoutExpired(cmd, timeout)
            with open(out) as stdout, open(err) as stderr:   # as text=True decodes
                return subprocess.CompletedProcess(cmd, status, stdout.read(), stderr.read())

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the test zygote ended (exit {self.proc.wait()}); see its stderr")
        return json.loads(line)


class RankZygote(_Server):
    """The rank server: ``python zygote.py --ranks SOCKET``, started on first use by a test
    process; mpirun's ranks reach it through ``tests/zygote_rank.py`` (``RANK_STUB``)."""

    @property
    def path(self) -> str:
        return os.path.join(self.files, "ranks.sock")

    def arguments(self) -> list[str]:
        return ["--ranks", self.path]


RANK_STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_rank.py")
RANK_SOCKET = "FEDMPI_TEST_RANK_ZYGOTE"


def _kill(pid, done: threading.Event):
    """A timeout: kill -9, as subprocess.run does (the server reaps the child; until it
    has answered, the pid is the child's or its zombie's)."""
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        return
    done.set()


# ---- the server --------------------------------------------------------------------------

def preload() -> list[str]:
    """Import what the commands import; returns sys.path less this script's folder and
    PYTHONPATH (what a fresh interpreter has after them: the standard library, site)."""
    import gc
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    assert "mpi4py.MPI" not in sys.modules, "the zygote must not initialise MPI"
    # Every object so far lives as long as the server: frozen, the children's collections
    # (and their last ones, at exit) skip them, and leave their pages shared.
    gc.freeze()
    return [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]


def serve() -> dict:
    """Preload, then fork one child per request; returns only in a child, with its request."""
    base_path = preload()
    print(json.dumps("ready"), flush=True)
    for line in iter(sys.stdin.readline, ""):
        request = json.loads(line)
        if threading.active_count() != 1:
            raise RuntimeError("the test zygote started a thread: it cannot fork")
        pid = os.fork()
        if pid == 0:
            request["base_path"] = base_path
            return request
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)
    sys.exit(0)


def serve_ranks(path: str) -> tuple[dict, list[int]]:
    """Preload, then serve mpirun's ranks on the Unix socket ``path`` (SOCK_SEQPACKET:
    one message a request): each connection brings a rank's request and its descriptors 0,
    1 and 2, and gets ``{"pid"}`` once its child exists, ``{"status"}`` once that has
    ended, or ``{"fresh": true}`` where the rank's environment changes what a fresh
    interpreter would read at start-up (the stub then execs one). The ranks of a launch
    arrive together: children run at once, reaped as SIGCHLD wakes the loop. Returns only
    in a child, with its request and descriptors; ends at the end of its input."""
    import select
    import signal
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)   # first: a path it cannot bind fails before seconds of imports
    listener.listen(64)
    base_path = preload()
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    print(json.dumps("ready"), flush=True)
    waiting = {}   # child pid -> its rank's connection
    while True:
        ready = select.select([listener, wake_r, 0], [], [])[0]
        if 0 in ready and not os.read(0, 4096):
            break   # the test process has closed our input
        if wake_r in ready:
            os.read(wake_r, 4096)   # the wake-ups: one byte per signal, nothing else
        if listener in ready:
            conn, _ = listener.accept()
            request, fds = _read_request(conn)
            if request is None:
                continue
            if rank_startup_differs(request["env"], dict(os.environ)):
                for fd in fds:
                    os.close(fd)
                _tell(conn, {"fresh": True})
                continue
            if threading.active_count() != 1:
                raise RuntimeError("the test rank zygote started a thread: it cannot fork")
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for sock in (listener, conn, *waiting.values()):
                    if sock is not None:
                        sock.close()
                for fd in (wake_r, wake_w):
                    os.close(fd)
                request["base_path"] = base_path
                return request, fds
            for fd in fds:
                os.close(fd)
            waiting[pid] = conn
            if not _tell(conn, {"pid": pid}, close=False):   # the stub has gone: so will the rank
                waiting[pid] = None
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                _tell(conn, {"status": os.waitstatus_to_exitcode(status)})
    sys.exit(0)


def _read_request(conn) -> tuple[dict | None, list[int]]:
    """A stub's request and its descriptors 0-2; (None, []) and the connection closed
    where it is not whole (the stub died mid-request, or something else wrote)."""
    import socket

    fds = []
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        if isinstance(request, dict) and {"argv", "env", "cwd", "pid"} <= set(request) \
                and request["argv"] and len(fds) == 3:
            return request, fds
    except (OSError, ValueError):
        pass
    for fd in fds:
        os.close(fd)
    conn.close()
    return None, []


def _tell(conn, answer: dict, close: bool = True) -> bool:
    """Send a stub ``answer``; False where it has gone (killed: nobody to tell)."""
    try:
        conn.send(json.dumps(answer).encode())
        told = True
    except OSError:
        told = False
    if close or not told:
        conn.close()
    return told


def become_rank(request: dict, fds: list[int]) -> None:
    """Turn this forked child into the rank's ``python ARGV`` (``-m MODULE ARGS`` or
    ``SCRIPT ARGS``) on the rank's own descriptors, and tie its life to the stub's: mpirun
    signals and kills the stub, which passes the signals it can catch on, and a stub
    killed outright (SIGKILL) takes this process with it."""
    import select
    import signal

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    argv = request["argv"]
    if argv[0] == "-m":
        _take_on(request, ["-m", *argv[2:]], None)   # runpy sets argv[0]
    else:
        _take_on(request, list(argv), os.path.dirname(os.path.abspath(argv[0])))
    try:
        stub = os.pidfd_open(request["pid"])
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)

    def die_with_the_stub():
        select.select([stub], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die_with_the_stub, daemon=True, name="zygote-rank").start()


_kept = []


def become(request: dict) -> None:
    """Turn this forked child into ``python -m MODULE ARGS`` as the request describes."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    os.close(null)
    _take_on(request, ["-m", *request["args"]], None)   # runpy puts the module's file first


def _take_on(request: dict, argv: list[str], first: str | None) -> None:
    """The request's working directory, environment, ``sys.argv`` and ``sys.path`` (``first``,
    the script's folder, or the working directory for ``-m``; then PYTHONPATH), and a
    ``sys.stdin`` on the new descriptor 0: the server's read the requests (kept, or its
    finaliser would close descriptor 0)."""
    _kept.append(sys.stdin)
    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first or os.getcwd(), *extra, *request["base_path"]]
    sys.argv = argv
    import importlib
    importlib.invalidate_caches()


def end(code) -> None:
    """End as ``sys.exit(code)`` ends a fresh interpreter, less the teardown of the modules
    and of the C++ libraries' statics, which leave nothing behind that a process's end
    does not: in a forked child they write to most of the pages it shares with the server,
    and copying those took 0.3 s of CPU per command, more than most commands. Kept: the
    exit status, the wait for non-daemon threads, the atexit handlers, MPI_Finalize in a
    rank (mpi4py's, at the very end of a teardown), and the flushes of stdout and stderr
    (status 120 where stdout's fails, as Python's). Where an HDF5 file
    is still open, whose closing the teardown would do, or ``code`` is a message, this
    returns and the interpreter's own ending runs whole."""
    import atexit

    if code is not None and not isinstance(code, int):
        return
    threading._shutdown()
    atexit._run_exitfuncs()   # which empties their list: the whole ending will not rerun them
    h5f = sys.modules["h5py"].h5f
    if h5f.get_obj_count(h5f.OBJ_ALL, h5f.OBJ_FILE):
        return
    mpi = sys.modules.get("mpi4py.MPI")   # a rank: MPI_Finalize, which mpi4py leaves to
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():   # the teardown
        mpi.Finalize()
    status = code or 0
    try:
        sys.stdout.flush()
    except Exception:
        status = 120
    try:
        sys.stderr.flush()
    except Exception:
        pass
    os._exit(status)


if __name__ == "__main__":
    import runpy
    if sys.argv[1:2] == ["--ranks"]:
        _request, _fds = serve_ranks(sys.argv[2])
        become_rank(_request, _fds)
        _argv = _request["argv"]
        del _request, _fds
        _run = (lambda: runpy.run_module(_argv[1], run_name="__main__", alter_sys=True)) \
            if _argv[0] == "-m" else (lambda: runpy.run_path(_argv[0], run_name="__main__"))
    else:
        _request = serve()
        become(_request)
        _module = _request["module"]
        del _request
        _run = lambda: runpy.run_module(_module, run_name="__main__", alter_sys=True)   # noqa: E731
    try:
        _run()
    except SystemExit as _exit:
        end(_exit.code)
        raise   # the interpreter's own ending, whole
    end(0)
