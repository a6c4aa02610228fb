"""What a run prints on stdout (unless quiet): the rank table, then one line a round; and
on stderr one warning line when the node was overloaded at start-up."""

from __future__ import annotations

import math

from ...errors import warn
from ..system import load_warning
from ..world import rank_table
from . import Observer


class Progress(Observer):
    def on_setup(self, exp) -> None:
        if exp.comm.is_server:
            print(rank_table(exp.ranks), flush=True)
            workers = [r["threads"] for r in exp.ranks[1:]] or [exp.ranks[0]["threads"]]
            warning = load_warning(max(workers))   # rank 0's node: a warning, not a decision
            if warning:
                warn(warning)

    def after_round(self, exp, record) -> None:
        rounds, row = exp.config.rounds, record.row
        acc = "" if math.isnan(row["test_acc"]) else f"  test_acc {row['test_acc']:.4f}"
        if record.round == 0:
            print(f"round {0:>4}/{rounds}  initial model{acc}  {row['time_wall']:.2f} s",
                  flush=True)
            return
        eta = row["time_wall"] * (rounds - record.round)
        print(f"round {record.round:>4}/{rounds}  train_loss {row['train_loss']:.4f}{acc}"
              f"  {row['time_wall']:.2f} s/round  eta {eta:.0f} s", flush=True)
