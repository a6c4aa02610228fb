"""Stop a tuning trial early (``fedmpi tune``'s pruner): after every evaluated round the
server hands the round's test accuracy to a judge (the Optuna trial's report and
should_prune, fedmpi.tune_worker); when the judge prunes before the last round, the
file is marked ``pruned`` at that round and every rank stops at the round's end, as
divergence stops them (the workers learn it from the next round's plan)."""

from __future__ import annotations

import math

from . import Observer

PRUNED = "pruned"


class Pruning(Observer):
    def __init__(self, judge):
        self.judge = judge   # (round, accuracy) -> whether to stop here

    def after_round(self, exp, record) -> None:
        accuracy = record.row.get("test_acc", math.nan)
        if exp.stop is not None or record.round == 0 or not math.isfinite(accuracy):
            return
        prune = self.judge(record.round, float(accuracy))
        if prune and record.round < exp.config.rounds:
            exp.writer.set_status(PRUNED, error=f"pruned at round {record.round} by the study's "
                                  f"pruner", pruned_round=record.round)
            exp.stop = PRUNED
