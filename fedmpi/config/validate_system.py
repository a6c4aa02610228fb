"""The simulated deployment's checks (``[system_model]``): the virtual clock's profiles,
tiers, availability and dropout, the round policies and asynchronous FL's settings, and
the files they read; ``validate.resolve_and_validate`` calls ``validate_system_model``."""

from __future__ import annotations

from .coerce import field_error, one_of as _one_of, positive as _positive
from .schema import ExperimentConfig
from .vocab import ASYNC_MODES, AVAILABILITY, POLICIES, PROFILES, STALENESS, STEP_UNITS

# deferred imports: fedmpi.runtime (the profile and trace files' readers, the clock's
# bound, the participation stages' refusals) and fedmpi.algorithms import this package (a
# cycle at load time) and torch, which this package must not load: fedmpi.analysis,
# torch-free, imports it. The checks that need them import them when they run.


def validate_system_model(c: ExperimentConfig) -> None:
    """``[system_model]``: names from the lists, numbers in range, and a policy other than
    waiting for all only with profiles to time the clients by."""
    from ..runtime.vclock_inputs import check_config_clock

    m = c.system_model
    _one_of("system_model.profiles", m.profiles, PROFILES)
    _one_of("system_model.policy", m.policy, POLICIES)
    _one_of("system_model.step_unit", m.step_unit, STEP_UNITS)
    _validate_tiers(m)
    for name in ("step_time", "down_mbps", "up_mbps"):
        _positive(f"system_model.{name}", getattr(m, name))
    _one_of("system_model.staleness", m.staleness, STALENESS)
    for name in ("speed_sigma", "bandwidth_sigma", "latency", "deadline", "overselect",
                 "concurrency", "buffer", "staleness_exponent"):
        _positive(f"system_model.{name}", getattr(m, name), allow_zero=True)
    inputs = _validate_availability(c)
    if m.profiles == "off":
        if m.policy != "wait_all":
            raise field_error("system_model.policy", f"{m.policy!r} times the clients: set "
                                                     f"system_model.profiles = \"lognormal\"")
        for name, on in (("availability", m.availability != "always"), ("dropout", m.dropout),
                         ("measure_step_time", m.measure_step_time)):
            if on:
                raise field_error(f"system_model.{name}", "runs on the virtual clock: set "
                                                          "system_model.profiles (\"lognormal\", "
                                                          "\"tiers\" or \"file\")")
        return
    if m.policy in ASYNC_MODES:
        # deferred (as above): what a participation stage refuses is the stage's own
        from ..runtime.participation import refuse
        refuse(c)
    if m.policy == "deadline" and not m.deadline:
        raise field_error("system_model.deadline", "policy \"deadline\" needs a deadline > 0 "
                                                   "(seconds a round waits)")
    if m.policy == "overselect":
        if not m.overselect:
            raise field_error("system_model.overselect", "policy \"overselect\" needs a fraction "
                                                         "> 0 (0.3 selects 30% more clients)")
        if c.clients.sampling == "bernoulli":
            raise field_error("system_model.policy", "\"overselect\" selects a fixed number of "
                                                     "clients; clients.sampling \"bernoulli\" "
                                                     "draws a random one (use uniform or size)")
    check_config_clock(c, *inputs)


def _validate_availability(c: ExperimentConfig) -> tuple:
    """Profiles from a file, availability and dropout: names from the lists, probabilities
    in range, files readable with the right columns and values. A static population's
    client ids are checked here against clients.num; a dynamic one's (more identities
    than clients.num, known once the partition is made) when the clock is set up.
    Returns the profile table and the trace read (None where there is none)."""
    from ..runtime.vclock_inputs import read_profiles, read_trace

    m = c.system_model
    _one_of("system_model.availability", m.availability, AVAILABILITY)
    static = None if c.clients.replace_prob else c.clients.num
    table = trace = None
    if m.profiles == "file":
        table = read_profiles(m.profile_file, static)
    elif m.profile_file:
        raise field_error("system_model.profile_file", f"is read with system_model.profiles = "
                                                       f"\"file\" only (profiles is {m.profiles!r})")
    if m.availability == "trace":
        trace = read_trace(m.availability_file, static)
    elif m.availability_file:
        raise field_error("system_model.availability_file", "is read with "
                          "system_model.availability = \"trace\" only (availability is "
                          f"{m.availability!r})")
    if not 0 < m.availability_p <= 1:
        raise field_error("system_model.availability_p", f"must be in (0, 1], got {m.availability_p}")
    for name in ("p_on_off", "p_off_on"):
        value = getattr(m, name)
        if not 0 < value <= 1:
            raise field_error(f"system_model.{name}", f"must be in (0, 1], got {value}")
    if not 0 <= m.diurnal_base <= 1:
        raise field_error("system_model.diurnal_base", f"must be in [0, 1], got {m.diurnal_base}")
    if not 0 <= m.diurnal_amplitude <= 1:
        raise field_error("system_model.diurnal_amplitude", f"must be in [0, 1], got "
                                                            f"{m.diurnal_amplitude}")
    if m.diurnal_base + m.diurnal_amplitude <= 0:
        raise field_error("system_model.diurnal_amplitude", "diurnal_base + diurnal_amplitude "
                                                            "must be > 0 (else nobody is ever "
                                                            "available)")
    if not 0 <= m.dropout < 1:
        raise field_error("system_model.dropout", f"must be in [0, 1), got {m.dropout}")
    return table, trace


TIER_LISTS = ("tier_shares", "tier_speeds", "tier_down_mbps", "tier_up_mbps")


def _validate_tiers(m) -> None:
    """``profiles = "tiers"``: the tier lists, one entry per tier, all positive numbers,
    the shares summing to 1, the names (if given) distinct; tier lists only with it."""
    given = [name for name in ("tier_names",) + TIER_LISTS if getattr(m, name)]
    if m.profiles != "tiers":
        if given:
            raise field_error(f"system_model.{given[0]}", "describes device tiers: set "
                                                         "system_model.profiles = \"tiers\"")
        return
    lists = {name: getattr(m, name) for name in TIER_LISTS}
    for name, values in lists.items():
        if not isinstance(values, list) or not values:
            raise field_error(f"system_model.{name}", "profiles \"tiers\" needs a list with "
                                                     "one number per tier")
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0]
        if bad:
            raise field_error(f"system_model.{name}", f"must be numbers > 0, got {bad[0]!r}")
    n = len(lists["tier_shares"])
    for name, values in list(lists.items()) + [("tier_names", m.tier_names or [None] * n)]:
        if len(values) != n:
            raise field_error(f"system_model.{name}", f"has {len(values)} entries, "
                                                     f"system_model.tier_shares {n}: one per tier")
    if abs(sum(lists["tier_shares"]) - 1) > 1e-6:
        raise field_error("system_model.tier_shares", f"must sum to 1, got "
                                                      f"{sum(lists['tier_shares']):g}")
    if m.tier_names and (len(set(map(str, m.tier_names))) != n or
                         not all(isinstance(x, str) and x for x in m.tier_names)):
        raise field_error("system_model.tier_names", f"must be distinct non-empty names, got "
                                                     f"{m.tier_names!r}")
