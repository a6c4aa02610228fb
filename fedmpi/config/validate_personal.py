"""Checks of local test splits and per-client evaluation (``partition.local_test``,
``eval.clients``, ``eval.client_finetune_epochs``): ranges and the fields they need."""

from __future__ import annotations

import math

from .coerce import INT_MAX, field_error
from .schema import ExperimentConfig
from .vocab import ASYNC_MODES, GROUP_MAX


def validate_personal(c: ExperimentConfig) -> None:
    p, e = c.partition, c.eval
    if isinstance(p.local_test, bool) or not isinstance(p.local_test, (int, float)) \
            or not 0 <= p.local_test < 1 or not math.isfinite(p.local_test):
        raise field_error("partition.local_test", f"must be a fraction in [0, 1) (0: no local "
                                                  f"test splits), got {p.local_test!r}")
    h = c.clients.holdout
    if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h < 1:
        raise field_error("clients.holdout", f"must be a fraction in [0, 1) (0: no held-out "
                                             f"clients), got {h!r}")
    if h and c.clients.num - held_out(c) < c.clients.per_round:
        raise field_error("clients.holdout", f"holds out {held_out(c)} of clients.num = "
                                             f"{c.clients.num}, fewer than clients.per_round = "
                                             f"{c.clients.per_round} left to train")
    if h and c.privacy.mechanism != "off":
        raise field_error("clients.holdout", "the privacy accounting's sampling rate is "
                                             "per_round / num over the whole population; "
                                             "held-out clients are not supported with "
                                             "[privacy] yet")
    if h and c.system_model.profiles != "off" and c.system_model.policy in ASYNC_MODES:
        raise field_error("clients.holdout", "asynchronous rounds draw from the whole "
                                             "population; held-out clients need a "
                                             "synchronous system_model.policy")
    clients = e.clients
    if isinstance(clients, bool) or not (clients in ("none", "all") or isinstance(clients, int)):
        raise field_error("eval.clients", f'must be "none", "all" or a number of clients, got '
                                          f'{clients!r}')
    if isinstance(clients, int) and not 1 <= clients <= c.clients.num:
        raise field_error("eval.clients", f"must be from 1 to clients.num = {c.clients.num} "
                                          f'(or "all"), got {clients}')
    ft = e.client_finetune_epochs
    if isinstance(ft, bool) or not isinstance(ft, int) or not 0 <= ft <= INT_MAX:
        raise field_error("eval.client_finetune_epochs", f"must be an integer >= 0 (0: no "
                                                         f"fine-tuning), got {ft!r}")
    fg = e.client_finetune_group
    if isinstance(fg, bool) or not isinstance(fg, int) or not 1 <= fg <= GROUP_MAX:
        raise field_error("eval.client_finetune_group", f"must be an integer in [1, {GROUP_MAX}] "
                                                        f"(1: one client after another), got {fg!r}")
    if fg > 1:
        if not ft:
            raise field_error("eval.client_finetune_group", "groups the fine-tuning; needs "
                                                            "eval.client_finetune_epochs > 0")
        from .. import models   # deferred: the models import the config's errors only late
        problem = models.group_problem(c.model.name, c.model.options)
        if problem:
            raise field_error("eval.client_finetune_group", f"{problem}; set 1 (one client "
                                                            f"after another)")
    if clients == "none":
        if h:
            raise field_error("clients.holdout", 'held-out clients are only evaluated; needs '
                                                 'eval.clients = "all" or N')
        if ft:
            raise field_error("eval.client_finetune_epochs", 'fine-tunes the evaluated clients; '
                                                             'needs eval.clients = "all" or N')
        return
    from ..algorithms import REGISTRY   # deferred: the algorithms import the config
    method = REGISTRY.get(c.algorithm.name)
    if method is not None and not method.supervised:
        raise field_error("eval.clients", f"scores a classifier on each client's test split; "
                                          f"algorithm {c.algorithm.name!r} learns an encoder "
                                          f"(kNN and the probes score it)")
    from ..data.registry import has_client_tests   # deferred: data imports the config
    if not p.local_test and not (p.kind == "natural" and has_client_tests(c.data.dataset)):
        raise field_error("eval.clients", "scores each client on its local test split; needs "
                                          "partition.local_test > 0 (e.g. 0.2), or a dataset "
                                          "whose files split each user (LEAF) under "
                                          "partition.kind = \"natural\"")


def held_out(c: ExperimentConfig) -> int:
    """H: the slots ``clients.holdout`` keeps out of training (at least 1 when on)."""
    h = c.clients.holdout
    return max(1, round(h * c.clients.num)) if h else 0
