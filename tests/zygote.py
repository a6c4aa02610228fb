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


# ---- the client: one server per test process, started on first use ----------------------

class Zygote:
    def __init__(self):
        self.env = dict(os.environ)
        self.files = tempfile.mkdtemp(prefix="fedmpi-zygote-")
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=self.env)
        self.lock = threading.Lock()
        ready = self.proc.stdout.readline()
        if json.loads(ready or "null") != "ready":
            raise RuntimeError(f"the test zygote did not start: {ready!r}")
        atexit.register(self.close)

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

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self):
        self.proc.stdin.close()   # the server ends at the end of its input
        self.proc.wait()
        self.proc.stdout.close()
        shutil.rmtree(self.files, ignore_errors=True)


def _kill(pid, done: threading.Event):
    """A timeout: kill -9, as subprocess.run does (the server reaps the child; until it
    has answered, the pid is the child's or its zombie's)."""
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        return
    done.set()


# ---- the server --------------------------------------------------------------------------

def serve() -> dict:
    """Preload, then fork one child per request; returns only in a child, with its request."""
    import gc
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    assert "mpi4py.MPI" not in sys.modules, "the zygote must not initialise MPI"
    # Every object so far lives as long as the server: frozen, the children's collections
    # (and their last ones, at exit) skip them, and leave their pages shared.
    gc.freeze()
    base_path = [p for p in sys.path[1:]
                 if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
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
    # The server's stdin object read the requests: a fresh one on /dev/null (the old one
    # kept, or its finaliser would close descriptor 0).
    _kept.append(sys.stdin)
    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *request["base_path"]]
    sys.argv = ["-m", *request["args"]]   # runpy puts the module's file first
    import importlib
    importlib.invalidate_caches()


def end(code) -> None:
    """End as ``sys.exit(code)`` ends a fresh interpreter, less the teardown of the modules
    and of the C++ libraries' statics, which leave nothing behind that a process's end
    does not: in a forked child they write to most of the pages it shares with the server,
    and copying those took 0.3 s of CPU per command, more than most commands. Kept: the
    exit status, the wait for non-daemon threads, the atexit handlers, and the flushes of
    stdout and stderr (status 120 where stdout's fails, as Python's). Where an HDF5 file
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
    _request = serve()
    become(_request)
    _module = _request["module"]
    del _request
    import runpy
    try:
        runpy.run_module(_module, run_name="__main__", alter_sys=True)
    except SystemExit as _exit:
        end(_exit.code)
        raise   # the interpreter's own ending, whole
    end(0)
