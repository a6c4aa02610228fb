"""Checks of ``[robust]`` and ``[attack]``: names, ranges, and what the rules assume."""

from __future__ import annotations

import math

from .coerce import INT_MAX, field_error
from .schema import ExperimentConfig
from .vocab import ASYNC_MODES

MODEL_ATTACKS = ("sign_flip", "scale", "gaussian")
COHORT_ATTACKS = ("alie", "ipm", "min_max", "min_sum")   # fedmpi.runtime.omniscient
DATA_ATTACKS = ("label_flip", "backdoor")                # fedmpi.runtime.poison
ATTACKS = ("none", *MODEL_ATTACKS, *COHORT_ATTACKS, *DATA_ATTACKS)


def validate_tracking(c: ExperimentConfig) -> None:
    t = c.tracking
    if t.tensorboard_dir and not t.tensorboard:
        raise field_error("tracking.tensorboard_dir", "is set but tracking.tensorboard is "
                                                      "false; turn it on or drop the folder")
    if (t.mlflow_uri or t.experiment) and not (t.mlflow or t.wandb):
        key = "tracking.mlflow_uri" if t.mlflow_uri else "tracking.experiment"
        raise field_error(key, "is set but no tracker is on (tracking.mlflow, tracking.wandb)")
    for key in ("tensorboard_dir", "mlflow_uri", "experiment"):
        if "\n" in getattr(t, key) or len(getattr(t, key)) > 4096:
            raise field_error(f"tracking.{key}", "must be one line of at most 4096 characters")


def validate_robust(c: ExperimentConfig) -> None:
    from ..runtime.robust import RULES   # deferred: the runtime imports the config
    r, a = c.robust, c.attack
    if r.aggregator not in RULES:
        raise field_error("robust.aggregator", f"{r.aggregator!r} is not allowed; choose one of "
                                               f"{', '.join(RULES)}")
    _integer("robust.f", r.f, 0)
    _integer("robust.geomed_iterations", r.geomed_iterations, 1)
    _integer("robust.cc_iterations", r.cc_iterations, 1)
    _integer("robust.root_per_class", r.root_per_class, 1)
    _positive("robust.bound", r.bound)
    _positive("robust.geomed_nu", r.geomed_nu)
    if a.kind not in ATTACKS:
        raise field_error("attack.kind", f"{a.kind!r} is not allowed; choose one of "
                                         f"{', '.join(ATTACKS)}")
    if isinstance(a.fraction, bool) or not isinstance(a.fraction, (int, float)) \
            or not 0 <= a.fraction < 1:
        raise field_error("attack.fraction", f"must be a fraction in [0, 1) (an attack needs "
                                             f"honest clients to attack), got {a.fraction!r}")
    if a.kind != "none" and not a.fraction:
        raise field_error("attack.fraction", f"attack.kind {a.kind!r} needs malicious clients; "
                                             f"set a fraction > 0 (e.g. 0.2)")
    for name in ("scale", "std"):
        value = getattr(a, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise field_error(f"attack.{name}", f"must be a finite number, got {value!r}")
    _positive("attack.std", a.std)
    _attack_options(c)
    if r.aggregator != "none":
        _refuse_robust(c)


def _attack_options(c: ExperimentConfig) -> None:
    from ..runtime.omniscient import DIRECTIONS   # deferred: the runtime imports the config
    a = c.attack
    if a.direction not in DIRECTIONS:
        raise field_error("attack.direction", f"{a.direction!r} is not allowed; choose one of "
                                              f"{', '.join(DIRECTIONS)}")
    if a.kind in COHORT_ATTACKS and c.robust.aggregator == "none":
        raise field_error("attack.kind", f"{a.kind!r} rewrites the updates where the robust "
                                         f"rules read them; set robust.aggregator (\"mean\" "
                                         f"for no defence)")
    _integer("attack.trigger", a.trigger, 1)
    if isinstance(a.target, bool) or not isinstance(a.target, int) or a.target < -1 \
            or a.target > INT_MAX:
        raise field_error("attack.target", f"must be -1 or a class >= 0, got {a.target!r}")
    p = a.poison_fraction
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise field_error("attack.poison_fraction", f"must be a fraction in (0, 1], got {p!r}")
    if a.kind == "backdoor" and a.target < 0:
        raise field_error("attack.target", "backdoor needs the trigger's label: a class >= 0")


def _refuse_robust(c: ExperimentConfig) -> None:
    from ..algorithms import REGISTRY   # deferred: the algorithms import the config
    from ..algorithms.base import fedavg_server_side, keeps_private_layers   # deferred: likewise
    r, n = c.robust, c.clients.per_round
    if not fedavg_server_side(REGISTRY[c.algorithm.name]):
        able = sorted(k for k, kind in REGISTRY.items() if fedavg_server_side(kind)
                      and not keeps_private_layers(kind))
        raise field_error("robust.aggregator", f"replaces the mean of the client deltas, "
                                               f"FedAvg's server side; {c.algorithm.name!r} has "
                                               f"its own; use one of {', '.join(able)}")
    if keeps_private_layers(REGISTRY[c.algorithm.name]):
        raise field_error("robust.aggregator", f"algorithm {c.algorithm.name!r} keeps private "
                                               f"layers; not supported with [robust] yet")
    if c.privacy.mechanism != "off":
        raise field_error("robust.aggregator", "[privacy]'s accounting assumes the noised "
                                               "mean; not supported with [robust] yet")
    if c.system_model.profiles != "off" and c.system_model.policy in ASYNC_MODES:
        raise field_error("robust.aggregator", "needs a synchronous system_model.policy")
    need = {"krum": 2 * r.f + 3, "multikrum": 2 * r.f + 3, "trimmed_mean": 2 * r.f + 1,
            "bulyan": 4 * r.f + 3}
    if r.aggregator in need and n < need[r.aggregator] and c.clients.sampling != "bernoulli":
        raise field_error("robust.f", f"{r.aggregator} with f = {r.f} needs at least "
                                      f"{need[r.aggregator]} clients a round "
                                      f"(clients.per_round = {n})")


def _integer(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= INT_MAX:
        raise field_error(name, f"must be an integer >= {low}, got {value!r}")


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (value > 0 and math.isfinite(value)):
        raise field_error(name, f"must be a finite number > 0, got {value!r}")
