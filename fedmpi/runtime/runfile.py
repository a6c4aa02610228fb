"""The server's results file at start: a new one, or the file of a run being resumed
(its state back from the checkpoint). One writer per file: both take its lock first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..errors import UsageError, warn
from ..results import ResultsWriter, RunFile, checkpoint, liveness, schema
from ..results.lock import RunLock
from ..results.recovery import recover_crashed
from . import participation
from .attacks import malicious
from .partial import PrivateLayers
from .records import RANK_FIELDS, ROUND_FIELDS, client_fields


def recorded_group(path) -> int | None:
    """The client group a run's file trained with last (its latest resume's, else its
    start's): what a resumed ``"auto"`` keeps. None where the file has none."""
    try:
        with RunFile(path) as run:
            attrs = dict(run.attrs)
    except (OSError, ValueError, KeyError):
        return None
    starts = [attrs] + list(attrs.get("resumes", []))
    groups = [r["client_group"] for r in starts if r.get("client_group")]
    return int(groups[-1]) if groups else None


def create_file(exp, dataset, ranks) -> bool:
    """A new results file; returns False: its initial model is not evaluated yet."""
    cfg, comm = exp.config, exp.comm
    provenance = {
        "git_commit": git_commit(), "world_size": comm.size,
        "num_workers": comm.num_workers, "ranks": ranks,
        "hostnames": sorted({r["host"] for r in ranks}),
        "seed": cfg.seed, "torch_version": torch.__version__, "python": sys.version.split()[0],
        "num_params": exp.d, "dataset_source": dataset.source,
        "dataset_sha256": dataset.sha256(),
        "algorithm_paper": exp.alg.paper, "command": command_line(),
        # what train.weight_decay amounts to under this method (Algorithm.effective_weight_decay)
        "effective_weight_decay": float(exp.alg.effective_weight_decay(cfg.train.weight_decay)),
        "writer": liveness.identity(), "eval_batch_size": exp.eval_batch,
        "client_group": exp.group,
    }
    if exp.group_probe:   # what "auto" timed before it chose (fedmpi.runtime.grouping)
        provenance["client_group_probe"] = exp.group_probe
    try:   # where the config's relative paths point from, for --resume and evaluate
        provenance["cwd"] = os.getcwd()
    except OSError:   # removed meanwhile: the paths resolve from wherever a resume runs
        pass
    sources = getattr(cfg, "algorithm_param_sources", None)   # set by config.resolve
    if sources is not None:
        provenance["algorithm_param_sources"] = dict(sources)
    partition = exp.split.file_datasets(dataset.train_y.numpy(), dataset.num_classes)
    if cfg.attack.kind != "none":   # [attack]: who attacks (fedmpi.runtime.attacks)
        partition["malicious"] = malicious(cfg)
    if len(exp.root):   # [robust] fltrust: the server's root set (fedmpi.runtime.robust)
        partition["robust_root"] = exp.root
    stage = exp.participation   # its columns, its provenance, its datasets under /partition
    round_fields = ROUND_FIELDS + list(exp.alg.diagnostic_fields) + stage.round_fields
    clients = client_fields(exp.alg, exp.wire) + stage.client_fields
    for own in (*exp.phases.stages, *exp.phases.aggregators):   # [attack], [robust]
        clients += [f for f in own.client_fields if f not in clients]
    private = next((s for s in exp.phases.stages if isinstance(s, PrivateLayers)), None)
    if private is not None:   # private layers: what travels (fedmpi.runtime.partial)
        provenance.update(shared_params=exp.wire, private_params=private.mask.d_private,
                          private_layers=private.mask.private_names)
    described, datasets = stage.describe()
    provenance.update(described)
    partition.update(datasets)
    for server in exp.phases.server_stages:   # privacy: epsilon, the mechanism's settings
        round_fields += server.round_fields
        provenance.update(server.describe())
    round_fields += exp.evaluator.round_fields   # eval.clients: client_acc_* summaries
    exp.lock = RunLock.acquire(cfg.output_path())
    exp.writer = ResultsWriter.create(
        cfg.output_path(), config=cfg.to_dict(), provenance=provenance,
        round_fields=round_fields, client_fields=clients, rank_fields=RANK_FIELDS,
        layout=exp.flat.layout_rows(), partition=partition, force=exp.force,
        tables=exp.evaluator.tables)
    return False


def take_over(path) -> tuple[Path, RunLock]:
    """An existing results file, ready to be written again (by a resume, or by `fedmpi
    evaluate`): its lock taken, and, if a writer died with it open, a clean copy in its
    place (said on stderr). A symbolic link is followed, so the lock and the repair are
    the file's (a repaired copy would replace the link, and the file stay broken).
    Returns the file's own path and its lock."""
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    lock = RunLock.acquire(path)
    try:
        recovered = recover_crashed(path)
    except BaseException:
        lock.release()
        raise
    if recovered:
        warn(f"fedmpi: {recovered}")
    return path, lock


def resume_file(exp, dataset, ranks) -> bool:
    """Continue the file's run: state from its checkpoint (or round 0 without one).
    Returns whether the file has the initial model's row (round 0)."""
    path, exp.lock = take_over(exp.config.output_path())
    with RunFile(path) as run:
        stored = run.partition()
        try:
            ckpt = run.checkpoint()
            damage = ckpt.skipped if ckpt is not None else []
        except checkpoint.Damaged as exc:   # nothing to continue from: as if never written
            ckpt, damage = None, [str(exc)]
        for line in damage:
            warn(f"fedmpi: {path}: {line}; resuming from "
                 f"{f'the one after round {ckpt.round}' if ckpt else 'round 0'}")
        if ckpt is not None:
            load_checkpoint(exp, ckpt)
        history = list(run.attrs.get("resumes", []))
        attrs = dict(run.attrs)
        rounds = run.rounds()
        evaluated = bool(np.any(rounds["round"] == 0))
    exp.participation.resume(path, exp.start, rounds, attrs, stored)
    # the data first: the partition is drawn from their labels
    data, was, now = exp.config.data, attrs.get("dataset_sha256"), dataset.sha256()
    if was is not None and was != now:   # files written before the digest have none
        what = f"was data.path = {data.options['path']} changed?" if "path" in data.options \
            else f"were the files in data.data_dir = {data.data_dir} changed?" if data.data_dir \
            else "was the code changed?"
        raise UsageError(f"--resume {path}: the {data.dataset!r} data differ from the run's "
                         f"(sha256 {was[:12]}..., now {now[:12]}...; {what})")
    if not np.array_equal(stored["client_offsets"], exp.split.offsets) or \
            not np.array_equal(stored["client_indices"], exp.split.indices):
        raise UsageError(f"--resume {path}: this fedmpi computes a different client partition "
                         f"from the file's config (was the code changed?)")
    # the torch and the kernels that computed the rounds up to here (the last resume's,
    # else the first start's; files from before either was recorded have none)
    starts = [attrs] + history
    torches = [v for v in (r.get("torch_version") for r in starts) if v]
    tables = [t for t in (r.get("ranks") or [] for r in starts) if schema.kernels_by_kind(t)]
    changes = []   # (what computed the rounds so far, what computes them now)
    if torches and torches[-1] != torch.__version__:
        changes.append((f"torch {torches[-1]}", f"torch {torch.__version__}"))
    if tables and schema.kernels_changed(tables[-1], ranks):
        changes.append((f"{_kernels(tables[-1])} kernels", f"{_kernels(ranks)} kernels"))
    if changes:
        was, now = (" with ".join(side) for side in zip(*changes))
        warn(f"fedmpi: {path} was run under {was} and resumes under {now}: rounds after "
             f"{exp.start} may differ in their last bits from a run that never stopped")
    history.append({"round": exp.start, "world_size": exp.comm.size,
                    "git_commit": git_commit(), "ranks": ranks,
                    "eval_batch_size": exp.eval_batch, "client_group": exp.group,
                    "torch_version": torch.__version__, "fedmpi_version": __version__})
    # the last stop's details would be stale once the run goes on
    exp.writer = ResultsWriter.resume(path, exp.start, resumes=history, error="",
                                      interrupted_round=None, failed_round=None,
                                      writer=liveness.identity())
    if damage:   # the next checkpoint goes over the damaged slot, not the intact one
        exp.writer.use_checkpoint(ckpt)
    return evaluated


def _kernels(ranks: list[dict]) -> str:
    """The kinds of kernels ``ranks`` ran, as one text ("" where none was recorded)."""
    return ", ".join(sorted(schema.kernels_by_kind(ranks)))


def load_checkpoint(exp, ckpt) -> None:
    missing = sorted(set(exp.state) - set(ckpt.server))
    if missing:
        raise UsageError(f"checkpoint lacks server state {missing} of algorithm "
                         f"{exp.config.algorithm.name!r}")
    exp.state = {k: torch.from_numpy(np.array(v)) for k, v in ckpt.server.items()}
    exp.participation.restore({k: exp.state.pop(k).numpy() for k in participation.STATE_KEYS
                               if k in exp.state})
    exp.store.load_state_dict(ckpt.states())
    exp.start = ckpt.round


def command_line() -> str:
    """The command as typed; bytes that are not UTF-8 (a file name in another encoding)
    as \\xNN, which the results file can store."""
    return " ".join(arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                    for arg in sys.argv)


def git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""
