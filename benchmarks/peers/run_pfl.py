"""pfl-research (Apple's pfl, PyTorch backend) on a peers workload file, in pfl's own environment.

How pfl is made to do the bare loop's work, step for step:

- the simulation: ``SimulatedBackend`` (one process, users trained one after another),
  ``FederatedAveraging`` with ``WeightByDatapoints`` (the sample-weighted mean, as fedmpi
  and the bare loop; pfl's default weights every user 1) and a central ``torch.optim.SGD``
  at learning rate 1 (the mean update applied as it is);
- the cohort: a user sampler that returns the workload's (round, client) pairs in order,
  so each round trains fedmpi's sampled clients; ``make_dataset_fn`` gives a client its
  samples in fedmpi's batch order for that round, which pfl's ``Dataset.iter`` cuts into
  the same batches (one local epoch, no shuffling);
- local training: pfl's own ``_sgd_train_step`` (``torch.optim.SGD`` from
  ``local_optimizer_create``, ``clip_grad_norm_`` at ``local_max_grad_norm``), the round's
  learning rate handed to the optimiser pfl makes (its hyperparameters are frozen
  dataclasses) by the callback that closes the previous round;
- no evaluation during training (``evaluation_frequency`` past the horizon, no validation
  cohort); the final model is scored by the shared ``common.accuracy``.

Each round's seconds are the time between the callbacks pfl calls after consecutive
central iterations (the first from the start of ``algorithm.run``). SGD steps are
counted in the model's ``loss``.
"""

from __future__ import annotations

import time

import torch

from common import cli, finish, load, loss

from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByDatapoints
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics
from pfl.model.pytorch import PyTorchModel


class Counted(torch.nn.Module):
    """fedmpi's model with the ``loss``/``metrics`` pfl calls; counts the training steps."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.steps = 0

    def forward(self, x):
        return self.inner(x)

    def loss(self, x, y):
        self.steps += 1
        return loss(self.inner, x, y)

    @torch.no_grad()
    def metrics(self, x, y):   # pfl's evaluation hook; not called (no evaluation rounds)
        return {"loss": loss(self.inner, x, y)}


class RoundClock(TrainingProcessCallback):
    """Each central iteration's seconds, and the next round's learning rate."""

    def __init__(self, lr):
        self.lr, self.rounds, self.current = lr, [], float(lr[0])

    def on_train_begin(self, *, model):
        self.last = time.perf_counter()
        return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        now = time.perf_counter()
        self.rounds.append(now - self.last)
        self.last = now
        if central_iteration + 1 < len(self.lr):
            self.current = float(self.lr[central_iteration + 1])
        return False, Metrics()


def main() -> None:
    args = cli(__doc__)
    w = load(args.workload)
    net = Counted(w.build_model())
    pairs = iter([(t, k) for t in range(w.rounds) for k in range(w.meta["per_round"])])

    def make_dataset(pair):
        x, y = w.client_data(*pair)
        return Dataset(raw_data=[x, y], user_id=pair)

    data = FederatedDataset(make_dataset, lambda: next(pairs))
    clock = RoundClock(w.lr)
    # pfl's hyperparameters are frozen: the round's rate reaches the optimiser it makes
    model = PyTorchModel(model=net,
                         local_optimizer_create=lambda ps, lr: torch.optim.SGD(ps, lr=clock.current),
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    train = NNTrainHyperParams(local_learning_rate=float(w.lr[0]), local_num_epochs=1,
                               local_batch_size=w.batch_size, local_max_grad_norm=w.grad_clip)
    backend = SimulatedBackend(training_data=data, val_data=None,
                               postprocessors=[WeightByDatapoints()])
    params = NNAlgorithmParams(central_num_iterations=w.rounds,
                               evaluation_frequency=w.rounds + 1,
                               train_cohort_size=w.meta["per_round"], val_cohort_size=0)
    FederatedAveraging().run(algorithm_params=params, backend=backend, model=model,
                             model_train_params=train,
                             model_eval_params=NNEvalHyperParams(local_batch_size=1000),
                             callbacks=[clock])
    finish("pfl", args, w, net.inner, clock.rounds, net.steps)


if __name__ == "__main__":
    main()
