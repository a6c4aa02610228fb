"""Drive an algorithm through the protocol on quadratic clients, in one process.

Client i's loss is f_i(w) = 0.5 ||w - c_i||^2 (its data only sets how many steps it
takes), so every local update has a closed form: a plain SGD step is
w <- w - lr (w - c_i). Tests compare an algorithm's rounds with numbers worked out by
hand or by a few lines of numpy. The round follows the runtime's order (phases,
participants, payload, local updates in client order, sums, gathered columns, client
state, server update); the runtime itself is exercised by the MPI/CLI tests.

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
from fedmpi.flat import FlatModel
from fedmpi.runtime.experiment import Contributions


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
            lr_prev: float | None = None, weight_decay: float = 0.0, clip_norm: float = 0.0,
            local_epochs: int = 1, num_clients: int = 10, global_lr: float = 1.0,
            seed: int = 0) -> RoundContext:
    return RoundContext(round=t, phase=phase, lr=lr, lr_prev=lr if lr_prev is None else lr_prev,
                        global_lr=global_lr, weight_decay=weight_decay, clip_norm=clip_norm,
                        local_epochs=local_epochs, batch_size=1, num_clients=num_clients,
                        participants=tuple(int(c) for c in participants), seed=seed)


class Simulation:
    """Server state, client states and rounds of one algorithm on given client tasks."""

    def __init__(self, alg, tasks: dict[int, ClientTask], x0):
        self.alg, self.tasks = alg, tasks
        x0 = torch.as_tensor(x0, dtype=torch.float32)
        self.d = x0.numel()
        self.state = alg.init_server_state(x0)
        self.client_states: dict[int, dict[str, torch.Tensor]] = {}
        self.last: dict[str, dict] = {}   # phase -> {"sums":..., "gathered":..., "uploads":...}

    def _client_state(self, c):
        sizes = self.alg.client_state_sizes(self.d)
        if not sizes:
            return None
        return self.client_states.get(c) or {k: torch.zeros(n) for k, n in sizes.items()}

    def round(self, participants, t: int = 0, **ctx_kw) -> dict[str, float]:
        """One round over ``participants`` (ascending); returns the diagnostics."""
        sampled = np.asarray(sorted(participants), dtype=np.int64)
        diagnostics = {}
        for phase in self.alg.phases:
            who = np.asarray(self.alg.phase_participants(self.state, phase, sampled))
            ctx = context(t, who, phase, **ctx_kw)
            payload = {k: v.clone() for k, v in self.alg.payload(self.state, ctx).items()}
            sizes = self.alg.contribution_sizes(self.d)
            folded = Contributions(sizes, torch.device("cpu"), keep_each=False)
            uploads, rows = {}, {}
            for c in who.tolist():
                upload = self.alg.local_update(self.tasks[c], payload, self._client_state(c), ctx)
                folded.add(self.alg.contribution(upload))
                if upload.state is not None:
                    self.client_states[c] = {k: v.detach().clone() for k, v in upload.state.items()}
                uploads[c] = upload
                rows[c] = self.alg.gather(upload)
            sums, offset = {}, 0
            for name, n in sizes.items():
                sums[name] = folded.sum[offset:offset + n]
                offset += n
            gathered = self._columns(who, uploads, rows)
            self.alg.server_update(self.state, sums, gathered, ctx)
            diagnostics.update(self.alg.diagnostics(self.state, sums, gathered, ctx))
            self.last[phase] = {"sums": sums, "gathered": gathered, "uploads": uploads}
        return diagnostics

    def _columns(self, who, uploads, rows) -> dict[str, np.ndarray]:
        """The per-client columns server_update receives, as the runtime builds them."""
        cols = {"client": who.astype(np.float64),
                "n_samples": np.array([uploads[c].num_samples for c in who], dtype=np.float64),
                "steps": np.array([uploads[c].steps for c in who], dtype=np.float64),
                "train_loss": np.array([uploads[c].loss for c in who], dtype=np.float64),
                "update_norm": np.array([float(uploads[c].delta.norm()) for c in who])}
        for name, n in self.alg.gather_sizes(self.d).items():
            values = np.array([rows[c][name].detach().double().reshape(-1).numpy()
                               if name in rows[c] else np.full(n, np.nan) for c in who])
            cols[name] = values.reshape(len(who), n).squeeze(1) if n == 1 else values.reshape(len(who), n)
        return cols
