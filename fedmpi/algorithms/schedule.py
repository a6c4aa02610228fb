"""Learning rates: eta_l^t over rounds, and its factor over a client's local steps.

Round t (0-based) starts its clients at ``round_lr(train, t, rounds)``; local step k of a
client's K steps (epochs of ``steps_per_epoch``) runs at eta_l^t times
``local_factor(ctx, k, steps_per_epoch, K)``. Both are pure functions of numbers, so a
client's learning rates never depend on where or when it trains.

    exponential  eta_l^t = lr decay^t                       (FL-Simulator, FedACG: x0.998)
    step         eta_l^t = lr decay^floor(t / lr_step)
    cosine       eta_l^t = lr_min + (lr - lr_min) (1 + cos(pi t / rounds)) / 2
                 (EasyFL's FedU/FedEMA baselines and the FedU^2 code: cosine over rounds)
    warm-up      x (t + 1) / warmup_rounds while t < warmup_rounds

    local step   x local_decay^(k // steps_per_epoch)       (FedACG's code: LambdaLR per epoch)
    local cosine x (1 + cos(pi k / K)) / 2
    local warm-up x (k + 1) / local_warmup while k < local_warmup
"""

from __future__ import annotations

import math

from ..errors import UsageError


def round_lr(train, t: int, rounds: int) -> float:
    """eta_l^t of ``train`` (a TrainConfig) in round t of a run of ``rounds`` rounds."""
    if train.lr_schedule == "step":
        lr = train.lr * train.lr_decay ** (t // train.lr_step)
    elif train.lr_schedule == "cosine":
        lr = train.lr_min + (train.lr - train.lr_min) * (1 + math.cos(math.pi * t / rounds)) / 2
    else:
        lr = train.lr * train.lr_decay ** t
    if t < train.warmup_rounds:
        lr *= (t + 1) / train.warmup_rounds
    return lr


def previous_lr(train, t: int, rounds: int, lr: float) -> float:
    """eta_l^{t-1}, what gradient-unit momentum divides last round's update by; round 0
    (no last round) gets lr / decay under the exponential schedule, as before schedules."""
    if train.lr_schedule == "exponential" and not train.warmup_rounds:
        return lr / train.lr_decay
    return round_lr(train, max(t - 1, 0), rounds)


def constant_within_round(ctx) -> bool:
    """True when every local step of a round runs at ctx.lr (the fast path)."""
    return ctx.local_schedule == "constant" and not ctx.local_warmup


def local_factor(ctx, k: int, steps_per_epoch: int, total: int) -> float:
    """The factor of local step k (0-based) of ``total`` on ctx.lr."""
    factor = 1.0
    if ctx.local_schedule == "step":
        factor = ctx.local_decay ** (k // max(steps_per_epoch, 1))
    elif ctx.local_schedule == "cosine":
        factor = (1 + math.cos(math.pi * min(k, total) / max(total, 1))) / 2
    if k < ctx.local_warmup:
        factor *= (k + 1) / ctx.local_warmup
    return factor


def require_constant_local(train, method: str, why: str) -> None:
    """Config time: refuse a learning rate that changes within a round for ``method``,
    whose formulas divide by K eta_l (``why`` says which)."""
    if train.local_schedule != "constant":
        field, value = "local_schedule", repr(train.local_schedule)
    elif train.local_warmup:
        field, value = "local_warmup", train.local_warmup
    else:
        return
    raise UsageError(f"config field train.{field}: {value} is not allowed with {method} ({why} "
                     f"assumes one learning rate per round); allowed: local_schedule = "
                     f"\"constant\" with local_warmup = 0")
