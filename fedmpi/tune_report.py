"""``fedmpi tune STUDY --status | --best``: each method's trials against the budget, and
its best trial (single objective) or its Pareto front (several), from the study's
journal. The last line says whether every method has had the same budget: the tuned
numbers compare only then."""

from __future__ import annotations

import math

from . import tune_worker as worker
from .tune import OBJECTIVES, Study

STATES = ("COMPLETE", "PRUNED", "FAIL", "RUNNING")


def summary(study: Study, best: bool) -> str:
    if not study.journal.exists():
        return (f"study {study.name}: no trials yet ({study.journal} does not exist); "
                f"run: fedmpi tune {study.path}")
    optuna = worker.optuna_module()
    store = worker.storage(study)
    goals = ", ".join(f"{o} ({OBJECTIVES[o.partition(':')[0]][0]}d)" for o in study.objectives)
    lines = [f"study {study.name}: {study.trials} trials per method; objective {goals}; "
             f"sampler {study.sampler}, pruner {study.pruner}; {study.directory}"]
    spent = {}
    for method in study.methods:
        target = worker.optuna_study(study, method, store)
        trials = target.get_trials(deepcopy=False)
        states = [t.state.name for t in trials]
        counts = ", ".join(f"{states.count(s)} {s.lower()}" for s in STATES if s in states)
        lines.append(f"{method.name}: {len(trials)}/{study.trials} trials"
                     f"{f' ({counts})' if counts else ''}")
        spent[method.name] = len(trials) - states.count("RUNNING")
        if best:
            done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
            lines += [f"  {line}" for line in _best(study, target, done)]
    short = [f"{name} {n}/{study.trials}" for name, n in spent.items() if n < study.trials]
    lines.append("every method has had the same budget: "
                 f"{study.trials} trials each" if not short else
                 f"budget not yet spent (finished trials): {', '.join(short)}; the methods do "
                 f"not compare yet")
    return "\n".join(lines)


def _best(study: Study, target, done) -> list[str]:
    if not done:
        return ["no completed trial"]
    directions = study.directions
    if len(directions) == 1:
        sign = -1.0 if directions[0] == "maximize" else 1.0
        chosen = [min(done, key=lambda t: (sign * t.values[0], t.number))]
        lines, prefix = [], "best: "
    else:
        chosen = sorted(target.best_trials, key=lambda t: t.number)   # Optuna's front
        lines, prefix = [f"Pareto front ({len(chosen)} of {len(done)} completed trials):"], "  "
    for trial in chosen:
        values = ", ".join(f"{o} {_number(v)}" for o, v in zip(study.objectives, trial.values))
        params = ", ".join(f"{k}={_number(v)}" for k, v in trial.params.items())
        lines.append(f"{prefix}trial {trial.number}: {values}; {params} -> "
                     f"{trial.user_attrs.get('output', '?')}")
    return lines


def _number(value) -> str:
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.4g}"
    return str(value)
