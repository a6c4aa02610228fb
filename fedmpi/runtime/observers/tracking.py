"""Live tracking (``[tracking]``): the server mirrors every /rounds row where researchers
already look (TensorBoard event files, an MLflow run, a W&B offline run), as it lands in
the results file. Each backend is an optional extra; one that is missing or fails says
so in one warning line and is dropped, and the run goes on: the HDF5 file stays the
record.

- TensorBoard: scalars ``rounds/<column>`` at step = round, the resolved config as text.
- MLflow: a run named after the results file, tagged ``fedmpi.results`` with its path
  (a resumed run continues the same MLflow run), the flattened config as parameters,
  every finite row value as a metric at step = round, the results file as an artifact
  when the run ends (FINISHED, or KILLED when it stops to be resumed, FAILED when it
  diverged).
- W&B: ``wandb.init(mode="offline")`` under the results file's folder, id keyed by the
  results path (a resume continues it), rows logged at step = round.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

from ...config import flatten, toml_value
from ...errors import warn
from . import Observer

# deferred imports: torch's SummaryWriter (it needs tensorboard), mlflow and wandb are
# optional extras, loaded only when [tracking] turns them on


class Tracking(Observer):
    def __init__(self):
        self.backends: list = []

    def on_setup(self, exp) -> None:
        t = exp.config.tracking
        if not exp.comm.is_server or not (t.tensorboard or t.mlflow or t.wandb):
            return
        for on, backend in ((t.tensorboard, TensorBoard), (t.mlflow, MLflow), (t.wandb, WandB)):
            if on:
                self._guard(backend.name, lambda: self.backends.append(backend(exp)))

    def after_round(self, exp, record) -> None:
        values = {k: float(v) for k, v in record.row.items()
                  if isinstance(v, (int, float)) and math.isfinite(v) and k != "round"}
        for backend in list(self.backends):
            self._guard(backend.name, lambda: backend.log(values, record.round), backend)

    def on_end(self, exp) -> None:
        status = "FINISHED" if exp.stop in (None, "pruned") else \
            "KILLED" if exp.stop == "preempted" else "FAILED"
        for backend in list(self.backends):
            self._guard(backend.name, lambda: backend.close(status), backend)
        self.backends = []

    def _guard(self, name: str, action, backend=None) -> None:
        try:
            action()
        except Exception as exc:   # a tracker never fails the run
            warn(f"fedmpi: tracking with {name} failed ({type(exc).__name__}: "
                 f"{str(exc).splitlines()[0] if str(exc) else 'no message'}); it is off for "
                 f"the rest of the run, whose results file is complete")
            if backend in self.backends:
                self.backends.remove(backend)


def _needs(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise RuntimeError(f"{module} is not installed (pip install 'fedmpi[{extra}]')") from None


def _config_text(exp) -> str:
    return "\n".join(f"{k} = {_text(v)}" for k, v in flatten(exp.config.to_dict()).items())


def _text(value) -> str:
    """A config value as TOML writes it (None, which TOML lacks, as its absence: "")."""
    return '""' if value is None else toml_value(value)


class TensorBoard:
    name = "TensorBoard"

    def __init__(self, exp):
        _needs("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        t, path = exp.config.tracking, exp.config.output_path()
        folder = Path(t.tensorboard_dir).expanduser() if t.tensorboard_dir else \
            path.with_name(path.stem + ".tb")
        self.writer = SummaryWriter(log_dir=str(folder))
        self.writer.add_text("config", f"```\n{_config_text(exp)}\n```", global_step=exp.start)

    def log(self, values: dict, step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"rounds/{key}", value, global_step=step)
        self.writer.flush()   # every round on disk, as the results file is

    def close(self, status: str) -> None:
        self.writer.close()


class MLflow:
    name = "MLflow"

    def __init__(self, exp):
        _needs("mlflow", "mlflow")
        import logging
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)   # its database's set-up lines

        t, path = exp.config.tracking, exp.config.output_path().absolute()
        uri = t.mlflow_uri or f"sqlite:///{path.parent / 'mlflow.db'}"
        _reachable(uri)   # else MLflow's HTTP retries hold the run for minutes
        self.client, self.path = MlflowClient(tracking_uri=uri), path
        name = t.experiment or exp.config.name
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else \
            self.client.create_experiment(name, artifact_location=_artifacts(uri, path))
        earlier = self.client.search_runs([experiment_id], filter_string=(
            f"tags.`fedmpi.results` = '{_quoted(str(path))}'"), max_results=1,
            order_by=["attributes.start_time DESC"])
        if earlier:   # a resumed results file: the same MLflow run, going on
            self.run_id = earlier[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(experiment_id, run_name=path.stem,
                                         tags={"fedmpi.results": str(path)})
            self.run_id = run.info.run_id
            from mlflow.entities import Param
            params = [Param(k, _text(v)[:6000]) for k, v in flatten(exp.config.to_dict()).items()]
            for i in range(0, len(params), 100):   # MLflow takes at most 100 a batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, values: dict, step: int) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self, status: str) -> None:
        self.client.log_artifact(self.run_id, str(self.path))
        self.client.set_terminated(self.run_id, status=status)


def _reachable(uri: str) -> None:
    """A tracking server answers a connection within 5 s (a server URI only)."""
    parts = urlparse(uri)
    if parts.scheme not in ("http", "https"):
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=5).close()
    except OSError as exc:
        raise ConnectionError(f"tracking.mlflow_uri {uri}: no server answers "
                              f"({exc.strerror or exc})") from None


def _artifacts(uri: str, path: Path) -> str | None:
    """A local store's artifacts beside its database; a server keeps its own default."""
    return (path.parent / "mlruns").as_uri() if uri.startswith("sqlite:///") else None


def _quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


class WandB:
    name = "W&B"

    def __init__(self, exp):
        wandb = self.wandb = _needs("wandb", "wandb")

        t, path = exp.config.tracking, exp.config.output_path().absolute()
        self.run = wandb.init(mode="offline", dir=str(path.parent),
                              project=t.experiment or exp.config.name, name=path.stem,
                              id=hashlib.sha1(str(path).encode()).hexdigest()[:16],
                              resume="allow", config=flatten(exp.config.to_dict()))

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
        if hasattr(self.wandb, "teardown"):   # W&B's service writes the offline records
            self.wandb.teardown()             # it holds when it stops, not at finish()
