"""Defaults that changed after results files were written with the older behaviour.

A file stores its resolved config, every algorithm parameter included, so a parameter
added later is absent from it. ``--resume`` must go on as the run began, not switch to
the new default halfway: ``as_started`` fills each such parameter with the value that
reproduces what the file's rounds ran with.
"""

from __future__ import annotations

# (the algorithms, the parameter, what files from before the parameter existed ran with)
CHANGED = (
    # the weight decay under client momentum: FL-Simulator's placement until "matched"
    # became the default (fedmpi.algorithms.momentum)
    (("fedcm", "mofedsam", "fedmrur"), "decay", "code"),
)


def as_started(values: dict) -> list[str]:
    """Fill the parameters ``values`` (a stored config dict) lacks with their old
    behaviour, in place; returns one line for each, to say so."""
    algorithm = values.get("algorithm") if isinstance(values, dict) else None
    if not isinstance(algorithm, dict):
        return []
    lines = []
    for names, key, before in CHANGED:
        if algorithm.get("name") in names and key not in algorithm:
            algorithm[key] = before
            lines.append(f"algorithm.{key} = {before!r}: the file predates the parameter and "
                         f"its rounds ran so (today's default differs)")
    return lines


# model options added after results files were written, with the value that builds the
# model those files ran: at that value an option is left out of the config's digest
# (``ExperimentConfig.digest``), so a config keeps its default results file name
ADDED_MODEL_OPTIONS = {"cnn": {"norm": "none"}}


def added_at_default(model: str, key: str, value) -> bool:
    """Whether flattened config key ``key`` (``model.<option>``) is an option added later
    to ``model``, at the value files written before it ran with."""
    option = key.split(".", 1)[1] if key.startswith("model.") else None
    added = ADDED_MODEL_OPTIONS.get(model, {})
    return option in added and added[option] == value
