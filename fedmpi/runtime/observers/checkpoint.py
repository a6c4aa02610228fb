"""Global and client state into the file every ``system.checkpoint_every`` rounds, and
after any round in which a rank was signalled (the preemption observer then stops)."""

from __future__ import annotations

from . import Observer


class Checkpoint(Observer):
    def after_round(self, exp, record) -> None:
        completed, every = record.round, exp.config.system.checkpoint_every
        if completed == 0 or exp.stop is not None or completed >= exp.config.rounds:
            return
        if record.signalled or (every and completed % every == 0):
            save(exp, completed)


def save(exp, completed: int) -> None:
    """Server: global and client state after ``completed`` rounds, into the file."""
    server = {k: v.detach().cpu().numpy() for k, v in exp.state.items()}
    server.update(exp.participation.state_dict())   # FedAsync/FedBuff: the versions in flight
    exp.writer.write_checkpoint(completed, server, exp.store.items(),
                                exp.state_sizes(), exp.split.num_identities)
