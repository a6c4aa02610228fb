"""One run's summary, what `fedmpi report FILE` prints: ``summarize(path)``.

A short plain-text summary, one fact per line. Config keys are read defensively: files
from older or partial configs still summarize, showing only what they record. The
probe names and order (``is_probe``, ``probe_order``) are shared with the tables of
``fedmpi.analysis.report``.
"""

from __future__ import annotations

import json
import math
import socket

import numpy as np

from fedmpi.analysis import render
from fedmpi.analysis.metrics import HOUR, last_measured, traffic_per_round_mb
from fedmpi.analysis.runs import get_key, latest_rows
from fedmpi.analysis.watch import duration, ending, file_age
from fedmpi.results import liveness, open_run, schema

_WIDTH = 13  # label column
_MB = 1e6  # MB here means 10^6 bytes, as network traffic is usually quoted
_SPLIT = ("compute", "comm", "aggregate", "eval")


def summarize(path) -> str:
    """File, status, experiment, progress, accuracy, traffic and timing, one fact per line."""
    with open_run(path) as run:
        attrs, config, rounds, evals = run.attrs, run.config, run.rounds(), run.evals()
        overrides = run.eval_overrides()
    lines = [("file", str(path)), ("status", _status(attrs, path))]
    lines += _experiment(config)
    lines += _parameters(config, attrs)
    lines += _decay(config, attrs)
    lines.append(("rounds", _progress(rounds, config)))
    lines += _accuracy(rounds)
    lines += _clients(rounds)
    lines += _traffic(rounds)
    lines += _ranks(attrs)
    lines += _timing(rounds)
    lines += _virtual(rounds)
    lines += _probes(evals, overrides)
    return "\n".join(f"{label:<{_WIDTH}}{text}" for label, text in lines)


def closing_lines(path) -> list[str]:
    """What `fedmpi run` prints as it ends: `watch`'s last word (rounds, final and best
    accuracy, training time) and the FL traffic, then the file."""
    with open_run(path) as run:
        attrs, config, status = run.attrs, run.config, run.status
        rounds = latest_rows(run.rounds(), by_block=False)
    lines = [ending(path, status, rounds, config, attrs)]
    lines += [f"{label}: {text}" for label, text in _traffic(rounds) if label == "FL traffic"]
    return lines + [f"results: {path}"]


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


def _clients(rounds: dict) -> list[tuple[str, str]]:
    """eval.clients: the last evaluation's per-client summaries, one line per model."""
    def last(field):
        values = np.asarray(rounds.get(field, ()), dtype=float)
        values = values[np.isfinite(values)]
        return values[-1] if values.size else None

    lines = []
    for label, prefix in (("local test", "client"), ("  fine-tuned", "personal"),
                          ("held-out", "holdout"), ("  fine-tuned", "holdout_personal")):
        mean = last(f"{prefix}_acc_mean")
        if mean is not None:
            lines.append((label, f"mean {_pct(mean)} over clients, weighted "
                                 f"{_pct(last(f'{prefix}_acc_weighted'))}, worst 10% "
                                 f"{_pct(last(f'{prefix}_acc_worst10'))}, median "
                                 f"{_pct(last(f'{prefix}_acc_p50'))}"))
    if last("participation_gap") is not None:
        lines.append(("gaps", f"participation {_pct(last('participation_gap'))}, out-of-sample "
                              f"{_pct(last('out_of_sample_gap'))}"))
    if lines:
        lines[0] = (lines[0][0], lines[0][1] + f" ({int(last('clients_evaluated'))} clients)")
    return lines


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
        again = resume.get("ranks") or []
        if schema.kernels_changed(ranks, again):
            text += f"; from round {resume.get('round')} on {_kernels(again)}"
        ranks = again if _kernels(again) else ranks
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
    if clock is None or np.all(np.isnan(clock)):
        return []
    total = float(clock[~np.isnan(clock)][-1])   # inf where the clock overflowed
    text = f"{render.hours(total / HOUR, None)} h ({total:.1f} s) on the simulated deployment"
    dropped = rounds.get("n_dropped")
    if dropped is not None and np.any(np.isfinite(dropped)):
        text += f", {int(np.nansum(dropped))} clients dropped"
    return [("virtual time", text)]


PROBE_ORDER = ("linear_acc", "effective_rank")


def is_probe(name: str) -> bool:
    return name in PROBE_ORDER or (name.startswith("finetune_") and name.endswith("pct_acc"))


def probe_order(name: str) -> tuple:
    """linear, the fine-tunings by fraction, then the effective rank."""
    if name.startswith("finetune_"):
        return (1, float(name[len("finetune_"):-len("pct_acc")]))
    return (0 if name == "linear_acc" else 2, 0.0)


def _probes(evals: dict, overrides: dict | None = None) -> list[tuple[str, str]]:
    """The last measurement of each probe of the encoder (/eval) and the round it probed,
    e.g. ``linear 22.00% (round 3), effective rank 11.42 (round 3)``; a row of `fedmpi
    evaluate` says so, with the eval.* settings it changed (``overrides``, by row)."""
    parts, overrides, posthoc = [], overrides or {}, evals.get("posthoc")
    rows = last_measured(evals)
    for name in sorted(filter(is_probe, rows), key=probe_order):
        row = rows[name]
        value, when = float(evals[name][row]), f"round {int(evals['round'][row])}"
        if posthoc is not None and posthoc[row] == 1:
            settings = overrides.get(row, ())
            when += ", fedmpi evaluate" + "".join(f" --set {o}" for o in settings)
        if name == "effective_rank":
            parts.append(f"effective rank {value:.2f} ({when})")
        else:
            label = "linear" if name == "linear_acc" else \
                f"fine-tune {name[len('finetune_'):-len('pct_acc')]}%"
            parts.append(f"{label} {100 * value:.2f}% ({when})")
    return [("probes", ", ".join(parts))] if parts else []
