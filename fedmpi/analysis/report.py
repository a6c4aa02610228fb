"""What `fedmpi report` prints: one run's summary (``summarize``, from
fedmpi.analysis.run_summary), or a paper-style table of many.

``report_table(runs, ...)``: runs grouped by config keys (seeds averaged) as in the
seed papers' tables: accuracy at chosen rounds, final and best accuracy, rounds to
target accuracies, FL traffic, wall time and FNR-FL's kappa and rho, each as
mean ± std over the group's runs; for runs with the virtual clock (system_model) also
the virtual hours to the targets and in all. Under the table: the config keys the runs
also differ in besides the grouping (``also differ: ...``), and each group whose runs
share seeds, whose ± is then a spread of replicas. The numbers come from
``fedmpi.analysis``; this module only chooses and lays out columns.
"""

from __future__ import annotations

import math

from fedmpi.analysis import render
from fedmpi.analysis.metrics import (CLIENT_SUMMARY, has_virtual_clock, kernels_line,
                                     posthoc_line, target_name, window_name)
# summarize lived here before run_summary; importing it from here still works
from fedmpi.analysis.run_summary import is_probe, probe_order, summarize  # noqa: F401
from fedmpi.analysis.tables import confounds, group_keys, group_table
from fedmpi.errors import UsageError

# --columns choices, in display order; acc needs --at, rounds and hours need --target,
# hours and vtime a run with the virtual clock.
COLUMNS = ("acc", "window", "final", "best", "rounds", "hours", "traffic", "upload", "per_round",
           "time", "vtime", "epsilon", "audit", "attack", "clients", "norm", "kappa", "rho",
           "probes")
_NUMBER_COLUMNS = {"traffic": ("traffic_mb", "traffic MB"), "upload": ("upload_mb", "up MB"),
                   "per_round": ("mb_per_round", "MB/round"), "time": ("time_s", "time s"),
                   "kappa": ("kappa", "kappa"), "rho": ("rho", "rho"),
                   "epsilon": ("epsilon", "ε"), "audit": ("audit_epsilon", "audit ε")}
# eval.clients: the per-client summaries, as the "clients" column shows them
_CLIENT_HEADERS = dict(zip(CLIENT_SUMMARY, (
    "local %", "local w10 %", "pers. %", "pers. w10 %", "new %", "new pers. %",
    "part. gap %", "o.o.s. gap %")))
_NO_CLOCK = "set system_model.profiles = \"lognormal\" to run with one"


def report_table(runs, group_by=None, at=(), targets=(), smooth=None, columns=None,
                 fmt: str = "text", windows=()) -> str:
    """Runs grouped by ``group_by`` (default: algorithm.name + the differing config keys),
    each group's metrics as mean ± std over its runs, as text, csv or markdown."""
    if fmt not in render.FORMATS:
        raise UsageError(f"--format {fmt!r}: allowed are {', '.join(render.FORMATS)}")
    keys = _keys(runs, group_by)
    # the final model's norm is read only when asked for: it opens every file's /model
    norm = bool(columns) and "norm" in columns
    rows = group_table(runs, keys, at, targets, smooth, windows, norm)
    probes = sorted((k[:-len("_mean")] for k in (rows[0] if rows else {})
                     if k.endswith("_mean") and is_probe(k[:-len("_mean")])), key=probe_order)
    scored = [f for f in _CLIENT_HEADERS if rows and f + "_mean" in rows[0]]
    chosen = _choose(columns, at, targets, bool(probes), any(has_virtual_clock(run) for run in runs),
                     any(_compressed(run) for run in runs), windows, _private(runs), bool(scored),
                     bool(rows) and "attack_success_mean" in rows[0])
    specs = _metric_specs(chosen, at, targets, probes, windows, scored)
    if fmt == "csv":
        return render.csv_table(rows, keys + ["status", "n", "seeds"] + [f for spec in specs for f in spec[2]])
    show_status = any(row["status"] != "completed" for row in rows)
    headers = [render.key_header(k, keys) for k in keys] + ["status"] * show_status + ["n"]
    headers += [spec[0] for spec in specs]
    # n reads "3 (1 seed)" where runs share seeds: the counts right-aligned among
    # themselves, the column then left-aligned so that the words follow them
    replicas = any(row["seeds"] < row["n"] for row in rows)
    digits = max((len(str(row["n"])) for row in rows), default=0) if fmt == "text" else 0
    cells = [[render.value(row[k]) for k in keys] + [row["status"]] * show_status
             + [render.runs_count(row["n"], row["seeds"], digits)] + [spec[1](row) for spec in specs]
             for row in rows]
    layout = render.markdown_table if fmt == "markdown" else render.text_table
    table = layout(headers, cells, left=len(keys) + show_status + replicas)
    notes = _notes(chosen, smooth, show_status, _replicas(rows, keys, show_status))
    also = confound_line(runs, keys)
    return table + "\n\n" + (also + "\n" if also else "") + notes


def _keys(runs, group_by) -> list[str]:
    return list(group_by) if group_by else group_keys(runs)


def confound_line(runs, group_by=None) -> str:
    """``also differ: train.weight_decay, ...``: config keys the rows differ in besides
    the grouping keys (``tables.confounds``), a line for probe values `fedmpi evaluate`
    measured (``metrics.posthoc_line``) and one for runs on other kernels
    (``metrics.kernels_line``); '' when none. Under a text or Markdown
    table; `fedmpi report --format csv` puts it on stderr, to keep the CSV pure."""
    keys = confounds(runs, _keys(runs, group_by))
    lines = [f"also differ: {', '.join(keys)}"] if keys else []
    lines += [line for line in (posthoc_line(runs), kernels_line(runs)) if line]
    return "\n".join(lines)


def _replicas(rows, keys, show_status) -> list[str]:
    """A note per group whose runs share seeds: their ± is the spread of replicas."""
    return [render.replicas(_label(row, keys, show_status), row["n"], row["seeds"])
            for row in rows if row["seeds"] < row["n"]]


def _label(row: dict, keys: list[str], show_status: bool) -> str:
    """A group as its row reads: ``fedavg, alpha=0.1`` (``(failed)`` when not completed)."""
    parts = [render.value(row[k]) if k == "algorithm.name" else
             f"{render.key_header(k, keys)}={render.value(row[k])}" for k in keys]
    if show_status and row["status"] != "completed":
        parts[-1] += f" ({row['status']})"
    return ", ".join(parts)


def _private(runs) -> tuple[bool, bool]:
    """Whether any run is private (``[privacy]``), and whether any was audited."""
    sections = [(run.config or {}).get("privacy") or {} for run in runs]
    return (any(p.get("mechanism", "off") != "off" for p in sections),
            any(p.get("audit_canaries", 0) for p in sections))


def _compressed(run) -> bool:
    """Whether the run's config compresses a message (``[compression]``)."""
    section = (run.config or {}).get("compression") or {}
    return section.get("up", "none") != "none" or section.get("down", "none") != "none"


def _choose(columns, at, targets, probes: bool = False, clock: bool = False,
            compressed: bool = False, windows=(), private=(False, False),
            clients: bool = False, attacked: bool = False) -> list[str]:
    """Chosen columns in display order; by default everything the options give numbers for
    (upload and per_round when a run compresses its messages; epsilon when one is private,
    audit when one was audited; attack when one scored a data attack; norm only when asked
    for)."""
    if not columns:
        return [c for c in COLUMNS if (c != "acc" or at) and (c != "window" or windows)
                and c != "norm" and (c not in ("rounds", "hours") or targets)
                and (c != "probes" or probes) and (c not in ("hours", "vtime") or clock)
                and (c not in ("upload", "per_round") or compressed)
                and (c != "epsilon" or private[0]) and (c != "audit" or private[1])
                and (c != "clients" or clients) and (c != "attack" or attacked)]
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:
        raise UsageError(f"--columns: unknown column {unknown[0]!r}; allowed: {', '.join(COLUMNS)}")
    if "acc" in columns and not at:
        raise UsageError("--columns acc needs --at ROUND (accuracy at that round)")
    if "window" in columns and not windows:
        raise UsageError("--columns window needs --window START:END (the mean accuracy over those rounds)")
    if "rounds" in columns and not targets:
        raise UsageError("--columns rounds needs --target ACC (rounds to reach that accuracy)")
    if "hours" in columns and not targets:
        raise UsageError("--columns hours needs --target ACC (virtual hours to reach that accuracy)")
    for name in ("hours", "vtime"):
        if name in columns and not clock:
            raise UsageError(f"--columns {name}: no run has a virtual clock ({_NO_CLOCK})")
    return [c for c in COLUMNS if c in columns]


def _metric_specs(chosen, at, targets, probes=(), windows=(), scored=()) -> list[tuple]:
    """(header, row -> display cell, raw CSV fields) per displayed column."""
    specs = []
    for name in chosen:
        if name == "clients":
            specs += [_acc_spec(_CLIENT_HEADERS[f], f) for f in scored]
        elif name == "probes":
            for field in probes:
                if field == "effective_rank":
                    specs.append(("eff. rank", lambda row: render.stat(row["effective_rank_mean"],
                                                                       row["effective_rank_std"]),
                                  ["effective_rank_mean", "effective_rank_std"]))
                else:
                    header = "linear %" if field == "linear_acc" else \
                        f"FT@{field[len('finetune_'):-len('pct_acc')]}% %"
                    specs.append(_acc_spec(header, field))
        elif name == "acc":
            specs += [_acc_spec(f"acc@{r} %", f"acc@{r}") for r in at]
        elif name == "window":
            specs += [_acc_spec(f"acc[{a}-{b}] %", window_name(a, b)) for a, b in windows]
        elif name == "norm":
            specs.append(("‖x‖", lambda row: render.stat(row["final_norm_mean"], row["final_norm_std"]),
                          ["final_norm_mean", "final_norm_std"]))
        elif name in ("final", "best"):
            specs.append(_acc_spec(f"{name} %", f"{name}_acc"))
        elif name == "attack":
            specs.append(_acc_spec("attack %", "attack_success"))
        elif name == "rounds":
            specs += [_rounds_spec(t) for t in targets]
        elif name == "hours":
            specs += [_hours_spec(t) for t in targets]
        elif name == "vtime":
            specs.append(("virtual h", lambda row: render.hours(row["virtual_h_mean"], row["virtual_h_std"]),
                          ["virtual_h_mean", "virtual_h_std"]))
        else:
            field, header = _NUMBER_COLUMNS[name]
            specs.append((header, lambda row, f=field: render.stat(row[f + "_mean"], row[f + "_std"]),
                          [f"{field}_mean", f"{field}_std"]))
    return specs


def _acc_spec(header: str, field: str) -> tuple:
    return (header, lambda row: render.stat(row[field + "_mean"], row[field + "_std"], percent=True),
            [f"{field}_mean", f"{field}_std"])


def _rounds_spec(target: float) -> tuple:
    field = f"rounds_to_{target_name(target)}"
    return (f"R@{100 * target:g}%",
            lambda row: render.rounds_stat(row[field + "_mean"], row[field + "_std"],
                                           row[field + "_reached"], row["n"]),
            [f"{field}_mean", f"{field}_std", f"{field}_reached"])


def _hours_spec(target: float) -> tuple:
    """H@x: virtual hours to the target; '-' for a group none of whose runs has the clock."""
    field = f"hours_to_{target_name(target)}"

    def cell(row):
        if math.isnan(row.get("virtual_h_mean", math.nan)):
            return "-"
        return render.hours_stat(row[field + "_mean"], row[field + "_std"], row[field + "_reached"], row["n"])
    return (f"H@{100 * target:g}%", cell, [f"{field}_mean", f"{field}_std", f"{field}_reached"])


def _notes(chosen, smooth, show_status, replicas=()) -> str:
    """What the numbers are, under the table (text and Markdown only)."""
    acc = "test accuracy in %" + (f", EMA({smooth:g})-smoothed over evaluated rounds" if smooth else "")
    notes = [f"mean ± std (sample std) over the n runs of a group; {acc}", *replicas]
    if "window" in chosen:
        notes.append("acc[a-b]: the mean of the raw (never smoothed) test accuracy over the "
                     "rounds a..b that were evaluated")
    if "norm" in chosen:
        notes.append("‖x‖: L2 norm of the final global model")
    if "rounds" in chosen:
        notes.append("R@x: first round whose accuracy reaches x, "
                     "mean over the runs that reached it (reached/n)")
    if "hours" in chosen:
        notes.append("H@x: virtual hours (the simulated deployment's clock, system_model) at the first "
                     "round whose accuracy reaches x, mean over the runs that reached it (reached/n); "
                     "- without the clock")
    units = [text for name, text in (("traffic", "traffic: FL MB (10^6 bytes) down + up"),
                                     ("upload", "up MB: FL MB uploaded"),
                                     ("per_round", "MB/round: FL MB down + up per trained round"),
                                     ("time", "time: sum of round wall times (s)"),
                                     ("vtime", "virtual h: the run's virtual time in hours"),
                                     ("epsilon", "ε: the accountant's epsilon after the last "
                                                 "round, at the run's delta (inf: no noise)"),
                                     ("audit", "audit ε: the one-run audit's lower bound "
                                               "on epsilon (95% confidence)"),
                                     ("kappa", "kappa = acc*1e4/time"),
                                     ("rho", "rho = acc*1e4/traffic")) if name in chosen]
    if units:
        ratio = " (FNR-FL; acc = final accuracy as a fraction)" if {"kappa", "rho"} & set(chosen) else ""
        notes.append("; ".join(units) + ratio)
    if "clients" in chosen:
        notes.append("per-client evaluation (eval.clients), at the last evaluation: local: the "
                     "global model's accuracy on each client's local test split, mean over "
                     "clients; w10: the mean of the worst 10% of clients; pers.: each "
                     "client's personal model (a personalised method's own, else the global "
                     "one) after eval.client_finetune_epochs of fine-tuning; new: held-out "
                     "clients (clients.holdout); part. gap: local - new; o.o.s. gap: the "
                     "training clients' accuracy on their training data - local")
    if "attack" in chosen:
        notes.append("attack %: a data attack's success at the last evaluation, the share of "
                     "the test samples it targets that the global model gives the attacker's "
                     "label (a backdoor: each with the trigger)")
    if "probes" in chosen:
        notes.append("probes of the final encoder (/eval): linear probe, fine-tuning on FT x% "
                     "labels, effective rank of the feature spectrum; test_acc is kNN accuracy")
    if show_status:
        notes.append("runs that did not complete are grouped apart by their status")
    return "\n".join(notes)
