"""Stop a run whose loss or parameters are NaN/Inf: the file says failed at which round."""

from __future__ import annotations

import math

import torch

from ...errors import warn
from . import Observer

DIVERGED = "diverged"


class Divergence(Observer):
    def after_round(self, exp, record) -> None:
        if record.round == 0 or not record.row["n_participants"]:
            return   # round 0 and a skipped round (nobody trained: train_loss is NaN)
        # Workers learn of a stop from the next round's plan; the file keeps every round.
        if not (math.isfinite(record.row["train_loss"]) and bool(torch.isfinite(exp.state["x"]).all())):
            # rounds count from 1 everywhere: /rounds/round, progress lines, failed_round
            exp.writer.set_status("failed", error=f"diverged at round {record.round}",
                                  failed_round=record.round)
            exp.stop = DIVERGED
            warn(f"fedmpi: training diverged at round {record.round} (NaN/Inf loss or parameters)")
