"""User-level differential privacy's accounting (``[privacy]``), from Google's
``dp-accounting`` library (the ``privacy`` extra): the event a run's rounds are, epsilon
after t rounds at the configured delta, and the noise multiplier that reaches a target
epsilon.

A round of central DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent
Language Models", ICLR 2018) is a Gaussian mechanism on the sum of the sampled clients'
clipped updates (sensitivity C, noise std sigma C), so its event is
``GaussianDpEvent(sigma)`` on the sampled clients:

- ``clients.sampling = "bernoulli"``: each client independently with q = S / N: Poisson
  sampling, ``PoissonSampledDpEvent(q, .)``, add/remove-one neighbours; the PLD
  accountant (tight) by default, RDP on request;
- ``"uniform"``: S of N without replacement: ``SampledWithoutReplacementDpEvent(N, S, .)``,
  replace-one neighbours, which only the RDP accountant supports.

The rounds compose: t rounds are ``SelfComposedDpEvent(event, t)``, and epsilon(t) is a
pure function of (event, t, delta): a resumed run's column continues exactly.

Local DP (``privacy.mechanism = "local"``): one client's round is a Gaussian (or Laplace)
mechanism of multiplier sigma / 2 (any two updates differ by at most 2C), unamplified;
epsilon(t) is a client's that took part in t rounds. Sample-level DP-SGD (``"sample"``):
a client's round is E ceil(n / B) Poisson-sampled Gaussian steps at q = min(1, B / n)
(``sample_epsilon``). Both take RDP under "auto" (closed form there), as does central DP
with a noise multiplier below PLD_MIN_SIGMA, where a PLD's grid explodes.
"""

from __future__ import annotations

import functools
import logging
import math

from .errors import UsageError

# the PLD's loss grid: 10x the library's default (1e-4), 9x faster per round (0.1 s against
# 0.9 s for 500 rounds at q = 0.1, sigma = 1), epsilon the same to 4 digits there; the PLD
# of a Gaussian is built pessimistically, so any grid gives an upper bound
PLD_GRID = 1e-3
PLD_MIN_SIGMA = 0.3   # "auto" takes RDP below this noise multiplier (accountant_of)
PLD_FLOOR = 0.1       # "pld" is refused below it (check_pld)
SAMPLE_DELTA = 1e-5   # sample-level DP's default delta (Opacus's and TF Privacy's examples')
INSTALL = "pip install 'fedmpi[privacy]' (dp-accounting)"


def _library():
    try:
        import dp_accounting   # deferred: an optional extra; only a private run needs it
        logging.getLogger("absl").setLevel(logging.ERROR)   # RDP's per-order convergence notes
    except ImportError:
        raise UsageError(f"config field privacy.mechanism: user-level DP's accounting needs "
                         f"the dp-accounting library; {INSTALL}") from None
    return dp_accounting


def delta_of(config) -> float:
    """The delta epsilon is reported at: ``privacy.delta``, or where 0, 1 / N^1.1 (N
    clients; sample-level DP: SAMPLE_DELTA, a record's)."""
    p = config.privacy
    if p.delta:
        return p.delta
    return SAMPLE_DELTA if p.mechanism == "sample" else 1.0 / config.clients.num ** 1.1


def count_std(config) -> float:
    """sigma_b, the std of adaptive clipping's count noise: ``privacy.count_noise``, or
    the expected clients a round / 20 (Andrew et al. 2021's choice) where 0."""
    p = config.privacy
    return p.count_noise if p.count_noise else config.clients.per_round / 20


def update_noise_multiplier(config) -> float:
    """The noise multiplier on the summed updates. With a fixed clip, sigma; with
    adaptive clipping sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^-1/2: the updates' Gaussian
    (sensitivity C) and the count's (sensitivity 1/2, the centred bits b_i - 1/2) compose
    into one Gaussian mechanism of multiplier sigma (Andrew et al. 2021, Theorem 1), which
    is what the accountant is told."""
    sigma = float(config.privacy.noise_multiplier)
    if not config.privacy.clip_quantile or not sigma:
        return sigma
    return (sigma ** -2 - (2 * count_std(config)) ** -2) ** -0.5


def sampling_rate(config) -> float:
    """q: the chance a given client is in a round's sample."""
    c = config.clients
    return c.per_round / c.num


def accountant_of(config, sigma: float | None = None) -> str:
    """``privacy.accountant`` resolved for noise multiplier ``sigma`` (the config's where
    None): "auto" is PLD for central DP (and `fedmpi privacy` on a config without a mechanism) under Poisson sampling with sigma >= PLD_MIN_SIGMA,
    else RDP. A PLD's grid spans the privacy loss, which grows as 1/sigma^2: at sigma 0.01
    one took 8 GB and minutes; below PLD_MIN_SIGMA epsilon is past 10 a round anyway, and
    RDP (closed form for local DP's unsampled Gaussian or Laplace) answers in milliseconds."""
    kind = config.privacy.accountant
    if kind != "auto":
        return kind
    sigma = config.privacy.noise_multiplier if sigma is None else sigma
    poisson = config.privacy.mechanism not in ("local", "sample") \
        and config.clients.sampling == "bernoulli"
    return "pld" if poisson and sigma >= PLD_MIN_SIGMA else "rdp"


def check_pld(config, sigma: float) -> None:
    """``privacy.accountant = "pld"`` asked for where its cost explodes: one line."""
    if config.privacy.accountant == "pld" and 0 < sigma < PLD_FLOOR:
        raise UsageError(f"config field privacy.accountant: \"pld\" at noise multiplier "
                         f"{sigma:.3g} (below {PLD_FLOOR:g}) takes minutes and gigabytes a "
                         f"round; use \"rdp\" or \"auto\"")


def _event_key(config) -> tuple:
    """What a round's event depends on besides sigma (hashable, for the cache)."""
    if config.privacy.mechanism == "local":
        return ("local", config.privacy.local_noise)
    c = config.clients
    return (c.sampling, c.num, c.per_round)


def round_event(config, sigma: float | None = None):
    """One round's DpEvent (``sigma``: the noise multiplier, the config's where None)."""
    return _event(_event_key(config), config.privacy.noise_multiplier if sigma is None else sigma)


def _event(key: tuple, sigma: float):
    """Central DP: the Gaussian on the sampled clients' sum. Local DP: one client's noised
    update, for any two updates it could send (replace-one: they differ by at most 2C,
    so the multiplier at sensitivity 1 is sigma / 2), not amplified by sampling.
    Sample-level DP-SGD: a client's round, its steps of the Poisson-sampled Gaussian."""
    dpa = _library()
    if key[0] == "sample":
        _, rate, steps = key
        step = dpa.GaussianDpEvent(sigma) if rate >= 1 else \
            dpa.PoissonSampledDpEvent(rate, dpa.GaussianDpEvent(sigma))
        return dpa.SelfComposedDpEvent(step, steps)
    if key[0] == "local":
        return (dpa.GaussianDpEvent if key[1] == "gaussian" else dpa.LaplaceDpEvent)(sigma / 2)
    sampling, num, per_round = key
    gaussian = dpa.GaussianDpEvent(sigma)
    if sampling == "bernoulli":
        return dpa.PoissonSampledDpEvent(per_round / num, gaussian)
    return dpa.SampledWithoutReplacementDpEvent(num, per_round, gaussian)


def _accountant(kind: str, key: tuple):
    """A fresh accountant: PLD, or RDP with the neighbouring relation of the sampling (local
    DP's events already price replacing an update in)."""
    dpa = _library()
    if kind == "pld":
        return dpa.pld.PLDAccountant(value_discretization_interval=PLD_GRID)
    relation = dpa.NeighboringRelation.REPLACE_ONE if key[0] == "uniform" \
        else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    return dpa.rdp.RdpAccountant(neighboring_relation=relation)


def epsilon(config, rounds: int, sigma: float | None = None) -> float:
    """Epsilon at ``delta_of(config)`` after ``rounds`` rounds; inf without noise. Local
    DP: a client's after it took part in ``rounds`` rounds (1: the per-round guarantee)."""
    sigma = config.privacy.noise_multiplier if sigma is None else sigma
    if rounds == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    return _epsilon(_event_key(config), accountant_of(config, sigma), delta_of(config), rounds,
                    float(sigma))


def sample_steps(config, n: int) -> tuple[float, int]:
    """DP-SGD on a client of n samples: (its Poisson rate q = min(1, B / n), its steps a
    round E ceil(n / B))."""
    b = config.train.batch_size
    return min(1.0, b / n), config.train.local_epochs * -(-n // b)


def sample_epsilon(config, n: int, rounds: int) -> float:
    """Sample-level DP-SGD: epsilon of a client of n samples after it took part in
    ``rounds`` rounds (inf without noise)."""
    sigma = float(config.privacy.noise_multiplier)
    if rounds == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    return _epsilon(("sample", *sample_steps(config, n)), accountant_of(config, sigma),
                    delta_of(config), rounds, sigma)


@functools.lru_cache(maxsize=4096)
def _epsilon(key, kind, delta, rounds, sigma) -> float:
    accountant = _accountant(kind, key)
    accountant.compose(_event(key, sigma), rounds)
    return float(accountant.get_epsilon(delta))


def calibrate(config, target: float, key: tuple | None = None) -> float:
    """The smallest noise multiplier whose epsilon after ``config.rounds`` rounds is at most
    ``target`` (dp-accounting's calibration, to a relative tolerance of 1e-4), for the
    round event of ``key`` (the config's where None; ``sample_calibrate``: a DP-SGD
    client's). Under PLD the search is bracketed by RDP's answer first: RDP's bound is the
    looser one, so its sigma is (checked) an upper end, and PLD's cost grows steeply as
    sigma falls (a search from small sigma took minutes)."""
    dpa = _library()
    delta, rounds, key = delta_of(config), config.rounds, key or _event_key(config)
    kind = config.privacy.accountant
    pld = kind == "pld" or accountant_of(config, PLD_MIN_SIGMA) == "pld"

    def spent(sigma):
        return _epsilon(key, accountant_of(config, sigma), delta, rounds, float(sigma))

    def search(kind, bracket):
        return float(dpa.calibrate_dp_mechanism(
            lambda: _accountant(kind, key),
            lambda sigma: dpa.SelfComposedDpEvent(_event(key, sigma), rounds),
            target, delta, bracket, tol=1e-4 * target))

    try:
        sigma = rdp = search("rdp", dpa.LowerEndpointAndGuess(1e-3, 1.0))
        check_pld(config, sigma)
        if pld and sigma >= PLD_FLOOR:
            for _ in range(8):
                if spent(sigma) <= target:
                    break
                sigma *= 1.5
            low = sigma / 2
            while low > PLD_FLOOR and spent(low) <= target:
                low /= 2
            sigma = search("pld", dpa.ExplicitBracketInterval(max(low, PLD_FLOOR / 2), sigma))
            if kind == "auto" and sigma < PLD_MIN_SIGMA:   # "auto" accounts with RDP there
                sigma = rdp
        reached = spent(sigma)
    except (ValueError, RuntimeError, OverflowError) as exc:
        reached, sigma = math.nan, " ".join(str(exc).split())
    if not reached <= target * (1 + 1e-9):   # the search stops where the accountant's floor is
        who = f" for the smallest client ({key[2]} steps a round at q = {key[1]:.4g})" \
            if key[0] == "sample" else ""
        raise UsageError(f"config field privacy.target_epsilon: no noise multiplier reaches "
                         f"epsilon = {target:g} at delta = {delta:g} over {rounds} rounds"
                         f"{who} (the search ended at sigma = {sigma}, epsilon {reached:.3g})")
    return sigma


def sample_calibrate(config, n: int, target: float) -> float:
    """Sample-level DP-SGD: the noise multiplier that keeps a client of n samples (the
    smallest, which spends the most) within ``target`` after ``config.rounds`` rounds."""
    return calibrate(config, target, ("sample", *sample_steps(config, n)))


def describe(config) -> dict:
    """The root attributes a private run's file carries."""
    return {"privacy_mechanism": config.privacy.mechanism,
            "privacy_noise_multiplier": float(config.privacy.noise_multiplier),
            "privacy_clip": float(config.privacy.clip), "privacy_delta": delta_of(config),
            "privacy_sampling_rate": sampling_rate(config),
            "privacy_accountant": f"dp-accounting {accountant_of(config).upper()}"
                                  + (f" (grid {PLD_GRID:g})" if accountant_of(config) == "pld" else ""),
            "privacy_event": "SelfComposedDpEvent(PoissonSampledDpEvent) a client's round"
                             if config.privacy.mechanism == "sample"
                             else type(round_event(config)).__name__,
            **({"privacy_local_noise": config.privacy.local_noise,
                "privacy_local_epsilon_per_round": epsilon(config, 1)}
               if config.privacy.mechanism == "local" else {}),
            **({"privacy_clip_quantile": float(config.privacy.clip_quantile),
                "privacy_clip_lr": float(config.privacy.clip_lr),
                "privacy_count_noise": count_std(config) if config.privacy.noise_multiplier else 0.0,
                "privacy_update_noise_multiplier": update_noise_multiplier(config)}
               if config.privacy.clip_quantile else {})}


def summary(config, target: float | None = None) -> str:
    """``fedmpi privacy``: what a config's rounds spend, or the noise a target needs."""
    c, p = config.clients, config.privacy
    if p.mechanism == "sample":
        raise UsageError("config field privacy.mechanism: sample-level DP's epsilon depends on "
                         "the clients' sizes, which the data give: a run writes it after "
                         "every round (/rounds/epsilon)")
    if p.mechanism == "local":
        head = (f"local DP, each client's update clipped to {p.clip:g} and noised with "
                f"{p.local_noise} noise, {config.rounds} rounds, delta = {delta_of(config):.3g}, "
                f"dp-accounting {accountant_of(config).upper()}")
    elif c.sampling == "size":
        raise UsageError("config field clients.sampling: the accounting needs Poisson "
                         "(\"bernoulli\") or fixed-size (\"uniform\") sampling, not \"size\"")
    else:
        how = f"Poisson, q = {sampling_rate(config):g}" if c.sampling == "bernoulli" else \
            "fixed size, without replacement"
        head = (f"user-level DP, a Gaussian mechanism on {c.per_round} of {c.num} clients a "
                f"round ({how}), {config.rounds} rounds, delta = {delta_of(config):.3g}, "
                f"dp-accounting {accountant_of(config).upper()}")
    if target is not None:
        if not target > 0:
            raise UsageError(f"--epsilon {target}: must be > 0")
        sigma = calibrate(config, target)
        return (f"{head}\nnoise multiplier for epsilon <= {target:g} after {config.rounds} "
                f"rounds: {sigma:.6g} (--set privacy.noise_multiplier={sigma:.6g}, or "
                f"privacy.target_epsilon = {target:g})")
    sigma = p.noise_multiplier
    marks = sorted({max(1, config.rounds // 10), max(1, config.rounds // 2), config.rounds})
    spent = ", ".join(f"{epsilon(config, t, sigma):.4g} after {t}" for t in marks)
    who = " (a client in every round)" if p.mechanism == "local" else ""
    return f"{head}\nnoise multiplier {sigma:g}, clip {p.clip:g}: epsilon{who} {spent} rounds"
