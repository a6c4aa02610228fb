"""Every simulated client's device (``system_model.profiles``): a speed, a multiplier of
the reference step time, a downlink and an uplink bandwidth and a latency, by which the
virtual clock (fedmpi.runtime.vclock) times its participation. A device is

- ``"lognormal"``: drawn once from the seed, lognormal around the configured medians
  (speed around 1), plus the fixed latency;
- ``"tiers"``: one of the named tiers, drawn by share;
- ``"file"``: a row of ``profile_file``, a CSV with a header row or an .npz with the
  columns client, speed, down_mbps, up_mbps, latency, every client id of the population
  exactly once (read and checked by fedmpi.runtime.vclock_inputs).

One device per client identity: a dynamic population has more than clients.num.
"""

from __future__ import annotations

import numpy as np

from .rng import numpy_rng
from .vclock_inputs import read_profiles


def device_profiles(model, seed: int, num_clients: int) -> dict[str, np.ndarray]:
    """The ``num_clients`` devices ``model`` (the SystemModelConfig) describes, as columns
    (fedmpi.runtime.vclock_inputs.PROFILE_FIELDS, and ``tier`` for tiers)."""
    if model.profiles == "file":
        return read_profiles(model.profile_file, num_clients)
    return draw_profiles(seed, num_clients, model)


def draw_profiles(seed: int, num_clients: int, model) -> dict[str, np.ndarray]:
    """Every client's device (``model``: the SystemModelConfig), keyed by the seed alone:
    speed ~ exp(N(0, speed_sigma)) (median 1), each bandwidth the configured median times
    exp(N(0, bandwidth_sigma)), latency the configured one; with ``profiles = "tiers"``
    each client's tier drawn by ``tier_shares`` (``tier``: its index) and the tier's
    speed and bandwidths."""
    if model.profiles == "tiers":
        rng = numpy_rng(seed, "device-tiers")
        shares = np.asarray(model.tier_shares, dtype=np.float64)
        tier = rng.choice(len(shares), size=num_clients, p=shares / shares.sum())
        return {"speed": np.asarray(model.tier_speeds, dtype=np.float64)[tier],
                "down_mbps": np.asarray(model.tier_down_mbps, dtype=np.float64)[tier],
                "up_mbps": np.asarray(model.tier_up_mbps, dtype=np.float64)[tier],
                "latency": np.full(num_clients, float(model.latency)), "tier": tier}
    rng = numpy_rng(seed, "device-profiles")
    speed = np.exp(model.speed_sigma * rng.standard_normal(num_clients))
    down = model.down_mbps * np.exp(model.bandwidth_sigma * rng.standard_normal(num_clients))
    up = model.up_mbps * np.exp(model.bandwidth_sigma * rng.standard_normal(num_clients))
    return {"speed": speed, "down_mbps": down, "up_mbps": up,
            "latency": np.full(num_clients, float(model.latency))}

