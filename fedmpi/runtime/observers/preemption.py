"""A signal (SIGUSR1/SIGTERM/SIGHUP/Ctrl-C) on any rank stops the run at the next round
boundary, resumable: the file is marked interrupted after the rounds it holds."""

from __future__ import annotations

from ... import signals
from ...errors import warn
from . import Observer

PREEMPTED = "preempted"
EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: checkpointed on a signal, resume to continue


class Preemption(Observer):
    def on_setup(self, exp) -> None:
        """A signal during start-up stops the run before its first round: the file exists
        and resumes from where this start began (its checkpoint, or round 0)."""
        flags = exp.comm.gather_obj(signals.requested(), count=False)
        if exp.comm.is_server and any(flags) and exp.start < exp.config.rounds:
            interrupt(exp, exp.start, f"stopped during start-up, at round {exp.start}")

    def after_round(self, exp, record) -> None:
        if exp.stop is not None or not record.signalled:
            return
        if record.round == 0:   # no checkpoint: the initial state is the config's
            interrupt(exp, 0, "stopped after evaluating the initial model (round 0)")
        elif record.round < exp.config.rounds:
            interrupt(exp, record.round, f"checkpointed after round {record.round}")


def interrupt(exp, completed: int, what: str, why: str = "signal received",
              error: str = "stopped by a signal (SIGUSR1/SIGTERM/SIGHUP/Ctrl-C)") -> None:
    """Server: mark the file resumable after ``completed`` rounds and stop every rank."""
    exp.writer.set_status("interrupted", error=error, interrupted_round=completed)
    exp.stop = PREEMPTED
    warn(f"fedmpi: {why}; {what}, exiting with {EXIT_PREEMPTED} "
         f"(resume with: fedmpi run --resume {exp.config.output_path()})")
