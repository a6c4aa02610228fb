"""``[privacy]``'s checks: names from the lists, numbers in range, the combinations the
private stages refuse (fedmpi.runtime.dp), and a target epsilon resolved into the noise
multiplier that reaches it (the resolved config says what ran)."""

from __future__ import annotations

import math

from .coerce import field_error, one_of as _one_of
from .schema import ExperimentConfig
from .vocab import PRIVACY_ACCOUNTANTS, PRIVACY_LOCAL_NOISES, PRIVACY_MECHANISMS

# the canaries: a coordinate, a sign and a membership each, scored once after the last
# round; at most one a model parameter (checked where the model is built)
MAX_CANARIES = 100_000
MAX_CLIP_LR = 10.0   # adaptive clipping's eta_C: C moves by at most e^10 a round

# deferred imports: fedmpi.privacy loads dp-accounting (an optional extra) and
# fedmpi.runtime imports this package (a cycle at load time); only a private config
# needs either, when it is checked


def validate_privacy(c: ExperimentConfig) -> None:
    p = c.privacy
    _one_of("privacy.mechanism", p.mechanism, PRIVACY_MECHANISMS)
    _one_of("privacy.accountant", p.accountant, PRIVACY_ACCOUNTANTS)
    _one_of("privacy.local_noise", p.local_noise, PRIVACY_LOCAL_NOISES)
    if p.mechanism != "central":
        for name in ("audit_canaries", "clip_quantile"):   # what only central DP has
            if getattr(p, name):
                raise field_error(f"privacy.{name}", f"needs privacy.mechanism = \"central\" "
                                                     f"(the audit and adaptive clipping act on "
                                                     f"the server's noised sum), not "
                                                     f"{p.mechanism!r}")
    if p.mechanism == "off":
        return
    if not p.clip > 0 or math.isinf(p.clip):
        raise field_error("privacy.clip", f"must be a finite number > 0 (the L2 norm each "
                                          f"update is clipped to), got {p.clip}")
    if not p.noise_multiplier >= 0:
        raise field_error("privacy.noise_multiplier", f"must be >= 0, got {p.noise_multiplier}")
    if p.target_epsilon < 0:
        raise field_error("privacy.target_epsilon", f"must be > 0 (0: use noise_multiplier), "
                                                    f"got {p.target_epsilon}")
    if p.delta and not 0 < p.delta < 1:
        raise field_error("privacy.delta", f"must be in (0, 1) (0: 1 / clients.num^1.1), "
                                           f"got {p.delta}")
    if p.accountant == "pld" and c.clients.sampling != "bernoulli" and p.mechanism == "central":
        raise field_error("privacy.accountant", f"\"pld\" accounts for Poisson sampling "
                                                f"(clients.sampling = \"bernoulli\"); "
                                                f"{c.clients.sampling!r} sampling needs \"rdp\" "
                                                f"(or \"auto\")")
    if not 0 <= p.clip_quantile < 1:
        raise field_error("privacy.clip_quantile", f"must be in (0, 1) (adaptive clipping's "
                                                   f"target quantile; 0: a fixed clip), got "
                                                   f"{p.clip_quantile}")
    if not 0 <= p.clip_lr <= MAX_CLIP_LR:
        raise field_error("privacy.clip_lr", f"must be in [0, {MAX_CLIP_LR:g}] (the clip moves "
                                             f"by at most exp(clip_lr) a round; the paper's "
                                             f"is 0.2), got {p.clip_lr}")
    if not 0 <= p.count_noise < math.inf:
        raise field_error("privacy.count_noise", f"must be a finite number >= 0 (0: "
                                                 f"clients.per_round / 20), got {p.count_noise}")
    if p.audit_canaries:
        if not 2 <= p.audit_canaries <= MAX_CANARIES:
            raise field_error("privacy.audit_canaries", f"must be 0 (no audit) or from 2 to "
                                                        f"{MAX_CANARIES}, got {p.audit_canaries}")
        if c.clients.sampling != "bernoulli":
            raise field_error("privacy.audit_canaries", f"the canaries join rounds as Poisson-"
                                                        f"sampled clients; needs clients.sampling "
                                                        f"= \"bernoulli\", not "
                                                        f"{c.clients.sampling!r}")
    from ..runtime.dp import refuse   # deferred (above)
    refuse(c)
    from .. import privacy            # deferred (above)
    if p.mechanism == "sample":
        privacy._library()            # the library is there: a run never fails for it later
        privacy.check_pld(c, p.noise_multiplier)   # target_epsilon: at start-up (the sizes)
    elif p.target_epsilon:
        p.noise_multiplier = privacy.calibrate(c, p.target_epsilon)
    else:
        privacy.round_event(c)        # the library is there: a run never fails for it later
        privacy.check_pld(c, p.noise_multiplier)
    if p.clip_quantile and p.noise_multiplier and \
            not 2 * privacy.count_std(c) > p.noise_multiplier:
        raise field_error("privacy.count_noise", f"adaptive clipping splits the noise multiplier "
                                                 f"{p.noise_multiplier:g} between the updates and "
                                                 f"the count, which needs 2 sigma_b > it; sigma_b = "
                                                 f"{privacy.count_std(c):g}; raise count_noise "
                                                 f"(or clients.per_round)")
