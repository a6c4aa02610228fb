"""fedmpi.signals under signals that arrive together.

A Python signal handler runs between two bytecodes of whatever the main thread is doing,
another handler included. `scancel` under srun gives each rank TERM (from slurmstepd) and
USR1 (the batch shell's trap, through srun) at the same moment, and preemption adds the
job's own USR1: the stop flag must be set without a lock, or a second signal inside the
first handler deadlocks the rank (it waits for a lock its own interrupted frame holds)
until SLURM's SIGKILL, and the results file stays `running`.
"""

import os
import signal
import subprocess
import sys
import textwrap

from conftest import ROOT
from fedmpi import signals

STORM = textwrap.dedent("""
    import os, signal, sys, threading, time
    from fedmpi import signals
    sys.setswitchinterval(1e-5)    # hand the GIL over often: signals land inside handlers
    signals.install()
    pid, loops, done = os.getpid(), [0], threading.Event()

    def storm():
        for _ in range(PAIRS):
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGUSR1)
            os.kill(pid, signal.SIGHUP)
        done.set()

    def watchdog():                # a deadlocked main thread makes no progress
        last = -1
        while loops[0] != last:
            last = loops[0]
            time.sleep(1.0)
        os.write(2, b"deadlocked in a signal handler")
        os._exit(3)

    threading.Thread(target=storm, daemon=True).start()
    threading.Thread(target=watchdog, daemon=True).start()
    while not done.is_set():
        signals.clear()
        loops[0] += 1
    signals.clear()
    os.kill(pid, signal.SIGUSR1)   # and the flag still works
    time.sleep(0.05)
    assert signals.requested()
    loops[0] = -2                  # finished: the watchdog's next look is its last
    print("ok", flush=True)
    os._exit(0)
""")


def test_stop_signals_arriving_inside_a_handler_do_not_deadlock():
    proc = subprocess.run([sys.executable, "-c", STORM.replace("PAIRS", "2000")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-2000:]


def test_ctrl_c_with_stderr_gone_still_stops_at_the_round(monkeypatch):
    """The Ctrl-C handler's notice to a stderr whose reader is gone (`2>&1 | head`) raised
    BrokenPipeError inside the handler, wherever the run was: the run failed instead of
    checkpointing. The notice is dropped; the request stands."""
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    read, write = os.pipe()
    os.close(read)   # no reader: a write raises BrokenPipeError (Python ignores SIGPIPE)
    saved = os.dup(2)
    try:
        os.dup2(write, 2)
        signals._handler(signal.SIGINT, None)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write)
    try:
        assert signals.requested()
    finally:
        signals.clear()
