"""Drive an algorithm through the protocol on quadratic clients, in one process.

Client i's loss is f_i(w) = 0.5 ||w - c_i||^2 (its data only sets how many steps it
takes), so every local update has a closed form: a plain SGD step is
w <- w - lr (w - c_i). Tests compare an algorithm's rounds with numbers worked out by
hand or by a few lines of numpy. Each phase is the runtime's own
(``fedmpi.runtime.phase.Phases.run``) over the in-process comm, so the tests check the
runtime's order (participants, payload, local updates in client order, sums, gathered
columns, client state, server update); MPI itself is exercised by the MPI/CLI tests.

    alg = build("fedavg", {})
    clients = {0: quadratic_task(0, center=[1.0, 0.0]), 1: quadratic_task(1, center=[0.0, 1.0])}
    sim = Simulation(alg, clients, x0=[0.0, 0.0])
    sim.round(participants=[0, 1], lr=0.1)
    sim.state["x"]          # global model after the round
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedmpi.algorithms import ClientTask, RoundContext
from fedmpi.algorithms.base import ClientData
from fedmpi.comm import LocalComm
from fedmpi.flat import FlatModel
from fedmpi.runtime.phase import Phases
from fedmpi.runtime.records import Timers, Traffic


class StepsData(ClientData):
    """``steps`` batches per epoch of dummy tensors; the loss ignores them."""

    def __init__(self, num_samples: int, steps: int):
        self.num_samples, self.steps = num_samples, steps

    def batches(self, epochs, batch_size):
        for _ in range(epochs * self.steps):
            yield torch.zeros(1, 1), torch.zeros(1, dtype=torch.int64)

    def num_steps(self, epochs, batch_size):
        return epochs * self.steps


class Vector(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d))


def quadratic_task(client: int, center, steps: int = 1, num_samples: int = 10) -> ClientTask:
    """A client with f(w) = 0.5 ||w - center||^2 taking ``steps`` local steps per epoch."""
    center = torch.as_tensor(center, dtype=torch.float32)
    flat = FlatModel(Vector(center.numel()))
    loss = lambda module, x, y: 0.5 * (module.w - center).square().sum()  # noqa: E731
    return ClientTask(client, StepsData(num_samples, steps), flat, torch.device("cpu"), loss)


def context(t: int = 0, participants=(), phase: str = "train", lr: float = 0.1,
            lr_prev: float | None = None, weight_decay: float = 0.0, grad_clip: float = 0.0,
            local_epochs: int = 1, num_clients: int = 10, global_lr: float = 1.0,
            seed: int = 0, **optimizer) -> RoundContext:
    """``optimizer``: RoundContext's local-optimizer fields (momentum, local_schedule, ...)."""
    return RoundContext(round=t, phase=phase, lr=lr, lr_prev=lr if lr_prev is None else lr_prev,
                        global_lr=global_lr, weight_decay=weight_decay, grad_clip=grad_clip,
                        local_epochs=local_epochs, batch_size=1, num_clients=num_clients,
                        participants=tuple(int(c) for c in participants), seed=seed,
                        **optimizer)


class Simulation:
    """Server state, client states and rounds of one algorithm on given client tasks."""

    def __init__(self, alg, tasks: dict[int, ClientTask], x0, stages=None):
        """``stages``: the client stages (fedmpi.runtime.stages) the phases run, in order
        (None: the runtime's default, no codec)."""
        self.alg, self.tasks, self.stages = alg, tasks, stages
        x0 = torch.as_tensor(x0, dtype=torch.float32)
        self.d = x0.numel()
        self.state = alg.init_server_state(x0)
        self.client_states: dict[int, dict[str, torch.Tensor]] = {}
        self.last: dict[str, dict] = {}   # phase -> {"sums":..., "gathered":..., "uploads":...}

    def get(self, c):
        """The runtime's client-state store interface (host arrays in, host arrays out)."""
        s = self.client_states.get(c)
        if s is None:
            return {k: np.zeros(n, dtype=np.float32) for k, n in self.alg.client_state_sizes(self.d).items()}
        return {k: v.numpy() for k, v in s.items()}

    def put(self, c, s):
        self.client_states[c] = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in s.items()}

    def round(self, participants, t: int = 0, **ctx_kw) -> dict[str, float]:
        """One round over ``participants`` (ascending); returns the diagnostics."""
        sampled = np.asarray(sorted(participants), dtype=np.int64)
        phases = Phases(LocalComm(), self.alg, self.d, torch.device("cpu"),
                        steps={c: 1 for c in self.tasks},
                        context=lambda t, phase, who: context(t, who, phase, **ctx_kw),
                        make_task=lambda c, ctx, p: self.tasks[c], store=self,
                        stages=self.stages)
        diagnostics = {}
        for p, phase in enumerate(self.alg.phases):
            uploads = {}

            def keep(c, upload, uploads=uploads):
                uploads[c] = upload
                return 0.0

            result = phases.run(self.state, t, p, phase, sampled, Timers(), Traffic(),
                                after_client=keep)
            diagnostics.update(result.diagnostics)
            self.last[phase] = {"sums": result.sums, "gathered": result.gathered,
                                "uploads": uploads}
        return diagnostics
