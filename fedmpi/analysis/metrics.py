"""Numbers the seed papers report, computed from one run's round rows.

Conventions (docs/analysis.md):

- Accuracy is a fraction in [0, 1]: the file's ``test_acc``. Rounds without evaluation
  hold NaN and are skipped; "the accuracy at round R" is the last evaluated value at or
  before R. Round 0, where a run has it (``eval.at_start``), is the initial model: a point
  of the curve like any other, with no FL traffic and no training.
- ``smooth=0.9`` replaces the accuracy curve by its exponential moving average over the
  evaluated rounds, seeded with the first (round 0's where evaluated),
  ``s_k = 0.9 s_{k-1} + 0.1 a_k``: FedACG reports accuracies smoothed this way. Every
  accuracy metric takes ``smooth``.
- Traffic is FL traffic (what the simulated deployment sends), down + up over all rounds,
  in MB = 10^6 bytes: FNR-FL's convention (its 8920 MB = 10 clients x 10 rounds x 2 x
  44.6 MB of ResNet-18 float32 weights).
- Wall time is the sum of the rounds' ``time_wall`` (round 0's evaluation included):
  training time, without process start-up, data loading and the gaps of a preempted and
  resumed run.
- FNR-FL's efficiency ratios use the final (unsmoothed) accuracy as a fraction:
  kappa = acc * 1e4 / time_s, rho = acc * 1e4 / traffic_MB (0.9976e4 / 6060 = 1.6462).
- Virtual time (runs with ``system_model.profiles`` on, whose rows have ``virtual_time``):
  the simulated deployment's clock at the end of each round, in hours here; 0 at round 0.
  Hours to a target are read at the same round as ``rounds_to``'s. Runs without the
  clock give None / NaN.

Every function takes a ``Run`` or a plain dict of round columns (``RunFile.rounds()``).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from fedmpi.results import schema

MB = 1e6
HOUR = 3600.0  # virtual seconds per hour


def _rounds(run) -> dict[str, np.ndarray]:
    """A Run's rows, a RunFile's (a method there) or the dict of columns itself."""
    rows = getattr(run, "rounds", run)
    return rows() if callable(rows) else rows


def ema(values, beta: float = 0.9) -> np.ndarray:
    """Exponential moving average seeded with the first value (no bias correction)."""
    values = np.asarray(values, dtype=np.float64)
    out = np.empty_like(values)
    level = None
    for i, v in enumerate(values):
        level = v if level is None else beta * level + (1 - beta) * v
        out[i] = level
    return out


def accuracy_curve(run, smooth: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rounds, accuracy) over the evaluated rounds only, EMA-smoothed if ``smooth``."""
    rows = _rounds(run)
    acc = np.asarray(rows.get("test_acc", ()), dtype=np.float64)
    ids = np.asarray(rows.get("round", np.arange(1, len(acc) + 1)))
    evaluated = np.isfinite(acc)
    acc, ids = acc[evaluated], ids[evaluated]
    return ids, (ema(acc, smooth) if smooth else acc)


def accuracy_at(run, round: int, smooth: float | None = None) -> float:
    """Last evaluated accuracy at or before ``round``; NaN if none, or if the run has
    not reached ``round`` (a stopped run is not credited with rounds it never ran)."""
    if round > last_round(run):
        return math.nan
    ids, acc = accuracy_curve(run, smooth)
    upto = np.flatnonzero(ids <= round)
    return float(acc[upto[-1]]) if len(upto) else math.nan


def final_accuracy(run, smooth: float | None = None) -> float:
    """The last evaluated accuracy (NaN if never evaluated)."""
    _, acc = accuracy_curve(run, smooth)
    return float(acc[-1]) if len(acc) else math.nan


def window_accuracy(run, start: int, end: int) -> float:
    """The mean of the raw (never smoothed) evaluated accuracies of rounds start..end, both
    included; NaN if the run has not reached ``end`` or evaluated nothing there. An EMA
    carries the early rounds on for dozens of evaluations (a method that starts slow looks
    behind long after it is not), a window mean does not."""
    if end > last_round(run):
        return math.nan
    ids, acc = accuracy_curve(run)
    inside = acc[(ids >= start) & (ids <= end)]
    return float(inside.mean()) if len(inside) else math.nan


def final_norm(run) -> float:
    """||x||_2 of the run's final global model (its whole flat state, summed in float64),
    NaN without one (a run still going, or a plain dict of rounds): a decay that acts
    harder shows as a smaller model."""
    return float(getattr(run, "final_norm", math.nan))


def best_accuracy(run, smooth: float | None = None) -> float:
    """The highest evaluated accuracy (NaN if never evaluated)."""
    _, acc = accuracy_curve(run, smooth)
    return float(acc.max()) if len(acc) else math.nan


def rounds_to(run, target: float, smooth: float | None = None) -> int | None:
    """First round whose (smoothed) accuracy is >= ``target`` (a fraction); None if never,
    0 if the initial model (round 0) already reaches it."""
    ids, acc = accuracy_curve(run, smooth)
    hit = np.flatnonzero(acc >= target)
    return int(ids[hit[0]]) if len(hit) else None


def last_round(run) -> int:
    """The last round recorded: the rounds done (0 when none, or only the initial
    model's round 0)."""
    ids = _rounds(run).get("round")
    return int(ids[-1]) if ids is not None and len(ids) else 0


def total_traffic_mb(run) -> float:
    """FL bytes down + up over all rounds, in MB (10^6 bytes); NaN if never recorded."""
    rows = _rounds(run)
    columns = [rows[k] for k in ("fl_bytes_down", "fl_bytes_up") if k in rows]
    if not any(np.any(np.isfinite(c)) for c in columns):
        return math.nan
    return float(sum(np.nansum(c) for c in columns)) / MB


def cumulative_traffic_mb(run) -> np.ndarray:
    """FL MB sent up to and including each round (one value per round row; 0 at round 0)."""
    rows = _rounds(run)
    n = len(rows.get("round", ()))
    total = np.zeros(n)
    for key in ("fl_bytes_down", "fl_bytes_up"):
        if key in rows:
            total += np.nan_to_num(rows[key], nan=0.0)
    return np.cumsum(total) / MB


def upload_mb(run) -> float:
    """FL bytes up over all rounds, in MB: what compression (``[compression] up``) cuts."""
    column = _rounds(run).get("fl_bytes_up")
    if column is None or not np.any(np.isfinite(column)):
        return math.nan
    return float(np.nansum(column)) / MB


def cumulative_upload_mb(run) -> np.ndarray:
    """FL MB uploaded up to and including each round (0 at round 0)."""
    rows = _rounds(run)
    column = rows.get("fl_bytes_up", np.zeros(len(rows.get("round", ()))))
    return np.cumsum(np.nan_to_num(column, nan=0.0)) / MB


def traffic_per_round_mb(run) -> float:
    """FL MB (down + up) per round that trained (round 0 excluded); NaN without any."""
    trained = last_round(run)
    return total_traffic_mb(run) / trained if trained else math.nan


def wall_time(run) -> float:
    """Seconds: the sum of the rounds' wall times; NaN if never recorded."""
    column = _rounds(run).get("time_wall")
    if column is None or not np.any(np.isfinite(column)):
        return math.nan
    return float(np.nansum(column))


def cumulative_time(run) -> np.ndarray:
    """Wall seconds up to and including each round (one value per round row)."""
    rows = _rounds(run)
    column = rows.get("time_wall", np.full(len(rows.get("round", ())), np.nan))
    return np.cumsum(np.nan_to_num(column, nan=0.0))


def has_virtual_clock(run) -> bool:
    """Whether the run's rows carry the virtual clock (``system_model.profiles`` on)."""
    return "virtual_time" in _rounds(run)


def cumulative_virtual_hours(run) -> np.ndarray:
    """The virtual clock at the end of each round row, in hours (0 at round 0); all NaN
    for a run without the clock."""
    rows = _rounds(run)
    column = rows.get("virtual_time", np.full(len(rows.get("round", ())), np.nan))
    return np.asarray(column, dtype=np.float64) / HOUR


def virtual_hours(run) -> float:
    """Virtual hours the whole run took on the simulated deployment: the clock at its last
    round (inf where it overflowed, in a file from before that was refused); NaN without
    the clock."""
    hours = cumulative_virtual_hours(run)
    known = hours[~np.isnan(hours)]
    return float(known[-1]) if len(known) else math.nan


def hours_to(run, target: float, smooth: float | None = None) -> float | None:
    """Virtual hours at the first round whose (smoothed) accuracy is >= ``target``: the
    round ``rounds_to`` gives; None if never reached or the run has no virtual clock."""
    if not has_virtual_clock(run):
        return None
    rows = _rounds(run)
    evaluated = np.isfinite(np.asarray(rows.get("test_acc", ()), dtype=np.float64))
    _, acc = accuracy_curve(run, smooth)
    hit = np.flatnonzero(acc >= target)
    return float(cumulative_virtual_hours(run)[evaluated][hit[0]]) if len(hit) else None


def kappa(run) -> float:
    """FNR-FL's time efficiency: final accuracy (fraction) * 1e4 / wall seconds."""
    return _ratio(final_accuracy(run), wall_time(run))


def rho(run) -> float:
    """FNR-FL's traffic efficiency: final accuracy (fraction) * 1e4 / FL traffic in MB."""
    return _ratio(final_accuracy(run), total_traffic_mb(run))


def _ratio(acc: float, denominator: float) -> float:
    if not math.isfinite(acc) or not math.isfinite(denominator) or denominator <= 0:
        return math.nan
    return acc * 1e4 / denominator


def last_value(run, column: str) -> float:
    """The last non-NaN value of a /rounds column (``epsilon`` after the last round, inf
    without noise; ``audit_epsilon``); NaN where the run has none."""
    values = np.asarray(_rounds(run).get(column, ()), dtype=np.float64)
    values = values[~np.isnan(values)]
    return float(values[-1]) if values.size else math.nan


PROBE_SKIP = ("round", "seconds", "posthoc")
# per-client evaluation's /rounds summaries that `fedmpi report` shows (their last values)
CLIENT_SUMMARY = ("client_acc_mean", "client_acc_worst10", "personal_acc_mean",
                  "personal_acc_worst10", "holdout_acc_mean", "holdout_personal_acc_mean",
                  "participation_gap", "out_of_sample_gap")


def last_measured(evals: dict) -> dict[str, int]:
    """Per /eval probe column (not round, seconds, posthoc): the row of its last measured
    (finite) value, whichever evaluation measured it; columns never measured are left out."""
    out = {}
    for name in (name for name in evals if name not in PROBE_SKIP):
        measured = np.flatnonzero(np.isfinite(np.asarray(evals[name], dtype=float)))
        if measured.size:
            out[name] = int(measured[-1])
    return out


def probe_results(run) -> dict[str, float]:
    """A self-supervised run's probes (/eval): per column (linear_acc, finetune_<p>pct_acc,
    effective_rank) its last measured value, whichever evaluation measured it; {} without."""
    evals = getattr(run, "evals", None) or {}
    return {name: float(evals[name][row]) for name, row in last_measured(evals).items()}


def posthoc_probes(run) -> dict[str, list[str]]:
    """{probe column: the eval.* settings `fedmpi evaluate` changed} for each column whose
    last value (the one ``probe_results`` reports) came from a row of `fedmpi evaluate`."""
    evals = getattr(run, "evals", None) or {}
    posthoc = evals.get("posthoc")
    if posthoc is None:
        return {}
    return {name: run.eval_overrides.get(row, []) for name, row in last_measured(evals).items()
            if posthoc[row] == 1}


def posthoc_line(runs) -> str:
    """``probes by fedmpi evaluate: linear_acc --set eval.linear_head=standard (17 of 17
    runs)``: the probe values a table shows that `fedmpi evaluate` measured, and with
    which settings; '' when none."""
    counts: dict[str, int] = {}
    for run in runs:
        for name, overrides in posthoc_probes(run).items():
            what = " ".join([name] + [f"--set {o}" for o in overrides])
            counts[what] = counts.get(what, 0) + 1
    parts = [f"{what} ({n} of {len(runs)} runs)" for what, n in sorted(counts.items())]
    return "probes by fedmpi evaluate: " + "; ".join(parts) if parts else ""


def kernels_line(runs) -> str:
    """``kernels differ: cpu AVX512 on AMD EPYC (20 of 51 runs), ...``: where the runs'
    ranks ran other kernels (``schema.kernels_by_kind``, over each run's start and
    resumes), which set the last bits; a chaotic method can end points apart on two kinds.
    '' when they agree, and runs that recorded none are left out. A run from before the
    CPU's model was recorded ("cpu AVX512") differs from the others only by its instruction
    set, as a resume compares them (``schema.kernels_changed``)."""
    per_run = []
    for run in runs:
        tables = [run.attrs.get("ranks")] + [r.get("ranks") for r in run.attrs.get("resumes") or []]
        kinds = frozenset(kind for table in tables if isinstance(table, list)
                          for kind in schema.kernels_by_kind(table))
        per_run += [kinds] if kinds else []
    isas = {frozenset(map(schema.instruction_set, kinds)) for kinds in per_run}
    known = {kinds for kinds in per_run if not any(map(schema.no_cpu_model, kinds))}
    if len(isas) < 2 and len(known) < 2:
        return ""
    counts = Counter(" + ".join(sorted(kinds)) for kinds in per_run)
    parts = [f"{kind} ({n} of {len(runs)} runs)" for kind, n in sorted(counts.items())]
    return "kernels differ: " + ", ".join(parts)


def summary(run, at=(), targets=(), smooth: float | None = None, windows=(),
            norm: bool = False) -> dict:
    """Every per-run number in one flat dict (the columns of ``runs_table``).

    Keys: rounds_done, final_acc, best_acc, acc@R per ``at``, window@A-B per ``windows``
    ((A, B) round pairs: the raw accuracy's mean over A..B, never smoothed), rounds_to_T
    per ``targets`` (None if never reached), traffic_mb, upload_mb, mb_per_round, time_s,
    kappa, rho, final_norm with ``norm`` (it reads the final model), and the probes of a
    self-supervised run (``probe_results``). A private run adds epsilon and audit_epsilon, a
    data attack attack_success; a run
    that scored its clients (eval.clients) the last CLIENT_SUMMARY values. A run with the virtual clock adds
    hours_to_T per ``targets`` (None if never reached) and virtual_h.
    """
    out = {"rounds_done": last_round(run),
           "final_acc": final_accuracy(run, smooth),
           "best_acc": best_accuracy(run, smooth)}
    out.update({f"acc@{r}": accuracy_at(run, r, smooth) for r in at})
    out.update({window_name(a, b): window_accuracy(run, a, b) for a, b in windows})
    if norm:
        out["final_norm"] = final_norm(run)
    out.update({f"rounds_to_{target_name(t)}": rounds_to(run, t, smooth) for t in targets})
    out.update(traffic_mb=total_traffic_mb(run), upload_mb=upload_mb(run),
               mb_per_round=traffic_per_round_mb(run), time_s=wall_time(run), kappa=kappa(run),
               rho=rho(run))
    rounds = _rounds(run)
    if "epsilon" in rounds:      # a private run: what its accountant and audit say
        out.update(epsilon=last_value(run, "epsilon"), audit_epsilon=last_value(run, "audit_epsilon"))
    out.update({f: last_value(run, f) for f in CLIENT_SUMMARY if f in rounds})   # eval.clients
    if "attack_success" in rounds:   # a data attack's success (fedmpi.runtime.poison)
        out["attack_success"] = last_value(run, "attack_success")
    if has_virtual_clock(run):
        out.update({f"hours_to_{target_name(t)}": hours_to(run, t, smooth) for t in targets})
        out["virtual_h"] = virtual_hours(run)
    out.update(probe_results(run))
    return out


def window_name(start: int, end: int) -> str:
    """The column of a window's mean accuracy: window@60-100."""
    return f"window@{start}-{end}"


def target_name(target: float) -> str:
    """0.8 -> "0.8": the shortest exact spelling, used in column names."""
    return f"{target:g}"
