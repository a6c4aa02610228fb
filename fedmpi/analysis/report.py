"""What `fedmpi report` prints: one run's summary, or a paper-style table of many.

``summarize(path)``: a short plain-text summary of one run. Config keys are read
defensively: files from older or partial configs still summarize, showing only what
they record.

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

import json
import math
import socket

import numpy as np

from fedmpi.analysis import render
from fedmpi.analysis.metrics import (HOUR, has_virtual_clock, target_name, traffic_per_round_mb,
                                     window_name)
from fedmpi.analysis.runs import get_key
from fedmpi.analysis.tables import confounds, group_keys, group_table
from fedmpi.analysis.watch import duration, file_age
from fedmpi.errors import UsageError
from fedmpi.results import liveness, open_run, schema

_WIDTH = 13  # label column
_MB = 1e6  # MB here means 10^6 bytes, as network traffic is usually quoted
_SPLIT = ("compute", "comm", "aggregate", "eval")


def summarize(path) -> str:
    """File, status, experiment, progress, accuracy, traffic and timing, one fact per line."""
    with open_run(path) as run:
        attrs, config, rounds, evals = run.attrs, run.config, run.rounds(), run.evals()
    lines = [("file", str(path)), ("status", _status(attrs, path))]
    lines += _experiment(config)
    lines += _parameters(config, attrs)
    lines += _decay(config, attrs)
    lines.append(("rounds", _progress(rounds, config)))
    lines += _accuracy(rounds)
    lines += _traffic(rounds)
    lines += _ranks(attrs)
    lines += _timing(rounds)
    lines += _virtual(rounds)
    lines += _probes(evals)
    return "\n".join(f"{label:<{_WIDTH}}{text}" for label, text in lines)


def _status(attrs: dict, path) -> str:
    recorded = attrs.get("writer")
    text = liveness.seen_status(str(attrs.get("status", "unknown")), recorded)
    writer = liveness.describe(recorded)
    if text == liveness.CRASHED:
        text += (f": the file says running, but its writer ({writer}) is gone; "
                 f"continue with: fedmpi run --resume {path}")
    elif text == "running" and liveness.state(recorded) == liveness.UNKNOWN:
        # a run on another node: only its file's age tells (a dead one stops changing)
        who = (f"its writer ({writer}) cannot be checked from {socket.gethostname()}"
               if isinstance(recorded, dict) else "it records no writer to check")
        text += f" as the file says, last changed {duration(file_age(path))} ago; {who}"
    elif text == "running":
        text += f" ({writer})"
    if attrs.get("failed_round") is not None:
        text += f" at round {attrs['failed_round']}"
    if attrs.get("error"):
        text += f": {attrs['error']}"
    created = attrs.get("created")
    return f"{text} (created {created}, fedmpi {attrs.get('fedmpi_version', '?')})" if created else text


def _experiment(config: dict) -> list[tuple[str, str]]:
    """Algorithm, data + partition, model, client counts: whichever the config has."""
    lines = []
    for label, key in (("algorithm", "algorithm.name"), ("dataset", "data.dataset"), ("model", "model.name")):
        if get_key(config, key) is not None:
            lines.append((label, str(get_key(config, key))))
    kind, alpha = get_key(config, "partition.kind"), get_key(config, "partition.alpha")
    if kind is not None:
        lines.append(("partition", f"{kind} (alpha={alpha})" if alpha is not None and kind == "dirichlet" else str(kind)))
    clients, per_round = get_key(config, "clients.num"), get_key(config, "clients.per_round")
    # clients.sampling: bernoulli makes per_round the expected count (the count varies)
    sampling = get_key(config, "clients.sampling", "uniform")
    how = {"bernoulli": " expected (bernoulli)", "size": " (size-weighted)"}.get(sampling, "")
    parts = [f"{clients} total" if clients is not None else None,
             f"{per_round}{how} per round" if per_round is not None else None]
    if any(parts):
        lines.append(("clients", ", ".join(p for p in parts if p)))
    return lines


def _parameters(config: dict, attrs: dict) -> list[tuple[str, str]]:
    """The algorithm's parameters with where each came from (``algorithm_param_sources``),
    e.g. ``beta=0.9 (default), lam=0.85 (preset)``; nothing for a file without them."""
    sources = attrs.get("algorithm_param_sources")
    table = get_key(config, "algorithm")
    if not isinstance(sources, dict) or not isinstance(table, dict):
        return []
    params = {k: v for k, v in table.items() if k != "name"}   # to_dict: params beside name
    if not params:
        return []
    parts = [f"{key}={_param(params[key])} ({sources.get(key, '?')})" for key in sorted(params)]
    return [("parameters", ", ".join(parts))]


def _decay(config: dict, attrs: dict) -> list[tuple[str, str]]:
    """train.weight_decay and what it amounts to under the method (client momentum
    re-applies last round's decay: ``effective_weight_decay``), with the placement the
    method was told; nothing without a decay or for a file that predates the record."""
    wd, effective = get_key(config, "train.weight_decay"), attrs.get("effective_weight_decay")
    if not wd or effective is None:
        return []
    placement = get_key(config, "algorithm.decay")
    text = f"{wd:g} a step; effective {float(effective):g}"
    return [("weight decay", text + (f" (algorithm.decay = {placement!r})" if placement else ""))]


def _param(value) -> str:
    text = json.dumps(value, default=str) if isinstance(value, (list, dict)) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _progress(rounds: dict, config: dict) -> str:
    """Trained rounds recorded: the initial model's row (round 0) is not one."""
    done = int(np.count_nonzero(_round_numbers(rounds) >= 1))
    planned = get_key(config, "rounds")
    return f"{done} of {planned} completed" if planned is not None else f"{done} completed"


def _round_numbers(rounds: dict) -> np.ndarray:
    """The recorded round ids, or 1..n if the file has no round column."""
    n = len(next(iter(rounds.values()), []))
    return rounds.get("round", np.arange(1, n + 1))


def _accuracy(rounds: dict) -> list[tuple[str, str]]:
    """Final = last evaluated round (NaN rows were not evaluated); best and when; the
    initial model's (round 0) when it was evaluated."""
    acc = rounds.get("test_acc")
    if acc is None or not np.any(np.isfinite(acc)):
        return []
    evaluated = np.flatnonzero(np.isfinite(acc))
    last, best = evaluated[-1], evaluated[np.argmax(acc[evaluated])]
    ids = _round_numbers(rounds)
    initial = [i for i in evaluated if ids[i] == 0]
    start = f", initial {_pct(acc[initial[0]])} (round 0)" if initial else ""
    return [("test acc", f"final {_pct(acc[last])} (round {ids[last]}), "
                         f"best {_pct(acc[best])} (round {ids[best]}){start}")]


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.2f}%"


def _total(rounds: dict, field: str) -> int | None:
    """Sum of a byte column, None when the column is absent or never measured."""
    column = rounds.get(field)
    if column is None or not np.any(np.isfinite(column)):
        return None
    return int(round(float(np.nansum(column))))


def _traffic(rounds: dict) -> list[tuple[str, str]]:
    lines = []
    down, up = _total(rounds, "fl_bytes_down"), _total(rounds, "fl_bytes_up")
    if down is not None or up is not None:
        total = (down or 0) + (up or 0)
        split = f": {_mb(down or 0)} down, {_mb(up or 0)} up"
        per_round = traffic_per_round_mb(rounds)
        per_round = f"; {per_round:.2f} MB a round" if math.isfinite(per_round) else ""
        lines.append(("FL traffic", f"{_mb(total)} ({total} bytes){split}{per_round}"))
    mpi = _total(rounds, "mpi_bytes")
    if mpi is not None:
        lines.append(("MPI traffic", f"{_mb(mpi)} ({mpi} bytes)"))
    return lines


def _ranks(attrs: dict) -> list[tuple[str, str]]:
    """Where the run ran: its ranks, their hosts and the kernels they ran, which decide
    the last bits (two runs agree bit for bit only on the same ones); a resume on other
    kernels is named with its round. Nothing for a file without its rank table."""
    ranks = attrs.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        return []
    hosts = sorted({str(r.get("host")) for r in ranks})
    workers = len(ranks) - 1
    roles = "server and worker" if not workers else f"1 server, {workers} worker{'s' if workers > 1 else ''}"
    text = (f"{len(ranks)} on {', '.join(hosts[:3])}{' and more' if len(hosts) > 3 else ''} "
            f"({roles})")
    kinds = _kernels(ranks)
    text += f"; {kinds}" if kinds else ""
    for resume in attrs.get("resumes") or []:
        again = _kernels(resume.get("ranks") or [])
        if again and again != kinds:
            text, kinds = text + f"; from round {resume.get('round')} on {again}", again
    return [("ranks", text)]


def _kernels(ranks: list[dict]) -> str:
    """"cpu AVX512", or each kind with its ranks where they differ."""
    kinds = schema.kernels_by_kind(ranks)
    if len(kinds) < 2:
        return next(iter(kinds), "")
    return ", ".join(f"{kind} ({schema.ranks_text(at)})" for kind, at in kinds.items())


def _mb(n_bytes: int) -> str:
    return f"{n_bytes / _MB:.2f} MB"


def _mean(rounds: dict, field: str) -> float | None:
    column = rounds.get(field)
    if column is None or not np.any(np.isfinite(column)):
        return None
    return float(np.nanmean(column))


def _timing(rounds: dict) -> list[tuple[str, str]]:
    """Mean wall seconds per round and how it splits, each part with its share of wall;
    over the trained rounds (round 0 only evaluates the initial model)."""
    trained = _round_numbers(rounds) >= 1
    rounds = {name: column[trained] for name, column in rounds.items()}
    wall = _mean(rounds, "time_wall")
    parts = [(name, _mean(rounds, f"time_{name}")) for name in _SPLIT]
    parts = [(name, sec) for name, sec in parts if sec is not None]
    lines = []
    if wall is not None:
        lines.append(("time/round", f"{wall:.3f} s mean wall"))
    if parts:
        share = (lambda s: f" ({100 * s / wall:.0f}%)") if wall and math.isfinite(wall) else (lambda s: "")
        lines.append(("  split", ", ".join(f"{name} {sec:.3f} s{share(sec)}" for name, sec in parts)))
    return lines


def _virtual(rounds: dict) -> list[tuple[str, str]]:
    """The virtual clock's total (runs with system_model.profiles on) and the clients it
    dropped; nothing for a run without it."""
    clock = rounds.get("virtual_time")
    if clock is None or not np.any(np.isfinite(clock)):
        return []
    total = float(clock[np.isfinite(clock)][-1])
    text = f"{render.hours(total / HOUR, None)} h ({total:.1f} s) on the simulated deployment"
    dropped = rounds.get("n_dropped")
    if dropped is not None and np.any(np.isfinite(dropped)):
        text += f", {int(np.nansum(dropped))} clients dropped"
    return [("virtual time", text)]


# --columns choices, in display order; acc needs --at, rounds and hours need --target,
# hours and vtime a run with the virtual clock.
COLUMNS = ("acc", "window", "final", "best", "rounds", "hours", "traffic", "upload", "per_round",
           "time", "vtime", "norm", "kappa", "rho", "probes")
_NUMBER_COLUMNS = {"traffic": ("traffic_mb", "traffic MB"), "upload": ("upload_mb", "up MB"),
                   "per_round": ("mb_per_round", "MB/round"), "time": ("time_s", "time s"),
                   "kappa": ("kappa", "kappa"), "rho": ("rho", "rho")}
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
                     if k.endswith("_mean") and _is_probe(k[:-len("_mean")])), key=_probe_order)
    chosen = _choose(columns, at, targets, bool(probes), any(has_virtual_clock(run) for run in runs),
                     any(_compressed(run) for run in runs), windows)
    specs = _metric_specs(chosen, at, targets, probes, windows)
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
    the grouping keys (``tables.confounds``); '' when none. Under a text or Markdown
    table; `fedmpi report --format csv` puts it on stderr, to keep the CSV pure."""
    keys = confounds(runs, _keys(runs, group_by))
    return f"also differ: {', '.join(keys)}" if keys else ""


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


PROBE_ORDER = ("linear_acc", "effective_rank")


def _is_probe(name: str) -> bool:
    return name in PROBE_ORDER or (name.startswith("finetune_") and name.endswith("pct_acc"))


def _probe_order(name: str) -> tuple:
    """linear, the fine-tunings by fraction, then the effective rank."""
    if name.startswith("finetune_"):
        return (1, float(name[len("finetune_"):-len("pct_acc")]))
    return (0 if name == "linear_acc" else 2, 0.0)


def _probes(evals: dict) -> list[tuple[str, str]]:
    """The last measurement of each probe of the encoder (/eval) and the round it probed,
    e.g. ``linear 22.00% (round 3), effective rank 11.42 (round 3)``."""
    parts = []
    for name in sorted(filter(_is_probe, evals), key=_probe_order):
        values = np.asarray(evals[name], dtype=float)
        measured = np.flatnonzero(np.isfinite(values))
        if not measured.size:
            continue
        value, when = values[measured[-1]], int(evals["round"][measured[-1]])
        if name == "effective_rank":
            parts.append(f"effective rank {value:.2f} (round {when})")
        else:
            label = "linear" if name == "linear_acc" else \
                f"fine-tune {name[len('finetune_'):-len('pct_acc')]}%"
            parts.append(f"{label} {100 * value:.2f}% (round {when})")
    return [("probes", ", ".join(parts))] if parts else []


def _compressed(run) -> bool:
    """Whether the run's config compresses a message (``[compression]``)."""
    section = (run.config or {}).get("compression") or {}
    return section.get("up", "none") != "none" or section.get("down", "none") != "none"


def _choose(columns, at, targets, probes: bool = False, clock: bool = False,
            compressed: bool = False, windows=()) -> list[str]:
    """Chosen columns in display order; by default everything the options give numbers for
    (upload and per_round when a run compresses its messages; norm only when asked for)."""
    if not columns:
        return [c for c in COLUMNS if (c != "acc" or at) and (c != "window" or windows)
                and c != "norm" and (c not in ("rounds", "hours") or targets)
                and (c != "probes" or probes) and (c not in ("hours", "vtime") or clock)
                and (c not in ("upload", "per_round") or compressed)]
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


def _metric_specs(chosen, at, targets, probes=(), windows=()) -> list[tuple]:
    """(header, row -> display cell, raw CSV fields) per displayed column."""
    specs = []
    for name in chosen:
        if name == "probes":
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
        if not math.isfinite(row.get("virtual_h_mean", math.nan)):
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
                                     ("kappa", "kappa = acc*1e4/time"),
                                     ("rho", "rho = acc*1e4/traffic")) if name in chosen]
    if units:
        ratio = " (FNR-FL; acc = final accuracy as a fraction)" if {"kappa", "rho"} & set(chosen) else ""
        notes.append("; ".join(units) + ratio)
    if "probes" in chosen:
        notes.append("probes of the final encoder (/eval): linear probe, fine-tuning on FT x% "
                     "labels, effective rank of the feature spectrum; test_acc is kNN accuracy")
    if show_status:
        notes.append("runs that did not complete are grouped apart by their status")
    return "\n".join(notes)
