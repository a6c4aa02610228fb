"""A toy algorithm that uses every feature of the protocol, with a closed-form answer.

Client i's objective is 0.5 ||x - c_i||^2 with c_i = (i + 1) / 10 * ones(d), so a local
update needs no data: one gradient step of size lam moves x to x + lam (c_i - x).

Round t, phase "train" (all sampled clients; payload x and server momentum m, 2d down):
    Delta_i = lam (c_i - x) - 0.1 m        upload Delta_i plus two gathered scalars (d + 2 up)
    client state: visits_i += 1, last_i = x + Delta_i
    server: m <- beta m + mean_i Delta_i;  x <- x + m;  selected = the 2 clients with the
            largest score ||c_i - x|| (ties: lower id)
Phase "refine" (only the selected; d down, d up):
    Delta_j = 0.25 (last_j - x)            (reads the state written in phase "train")
    server: x <- x + mean_j Delta_j
``reference`` recomputes the same recursion in float64 with plain numpy.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from fedmpi.algorithms import Algorithm, Upload, register
from fedmpi.algorithms.base import Params
from fedmpi.runtime.plan import sample_clients


def target(c, d, like=None):
    return torch.full((d,), (c + 1) / 10, dtype=torch.float32)


@register
class ToyProbe(Algorithm):
    name = "toy_probe"
    paper = "test fixture"
    phases = ("train", "refine")

    @dataclass(frozen=True)
    class Params(Params):
        lam: float = field(default=0.5, metadata={"doc": "local step"})
        beta: float = field(default=0.5, metadata={"doc": "server momentum"})

    def traffic(self, d, phase):
        return (2 * d, d + 2) if phase == "train" else (d, d)

    def client_state_sizes(self, d):
        return {"visits": 1, "last": d}

    def gather_sizes(self, d, phase=None):
        return {} if phase == "refine" else {"visits": 1, "score": 1}   # refine gathers nothing

    def init_server_state(self, x):
        return {"x": x.clone(), "m": torch.zeros_like(x), "selected": torch.zeros(0, dtype=torch.int64)}

    def phase_participants(self, state, phase, sampled):
        return sampled if phase == "train" else state["selected"].numpy()

    def payload(self, state, ctx):
        return {"x": state["x"], "m": state["m"]} if ctx.phase == "train" else {"x": state["x"]}

    def local_update(self, task, payload, client_state, ctx):
        x = payload["x"]
        d = x.numel()
        if ctx.phase == "train":
            c = target(task.client, d).to(x.device)
            delta = self.params.lam * (c - x) - 0.1 * payload["m"]
            state = {"visits": client_state["visits"] + 1, "last": x + delta}
            extras = {"visits": state["visits"], "score": torch.linalg.vector_norm(c - x).reshape(1)}
        else:
            delta = 0.25 * (client_state["last"] - x)
            state, extras = client_state, {}
        return Upload(delta=delta, num_samples=1, loss=0.0, steps=0, extras=extras, state=state)

    def gather(self, upload):
        return upload.extras

    def server_update(self, state, sums, gathered, ctx):
        mean = sums["delta"] / sums["weight"]
        if ctx.phase == "train":
            state["m"].mul_(self.params.beta).add_(mean)
            state["x"].add_(state["m"])
            order = np.lexsort((gathered["client"], -gathered["score"]))
            state["selected"] = torch.as_tensor(np.sort(gathered["client"][order[:2]]).astype(np.int64))
        else:
            state["x"].add_(mean)


def reference(x0, seed, rounds, num_clients, per_round, lam=0.5, beta=0.5):
    """The same recursion in float64 numpy: final x, visits per client, FL bytes per round."""
    x = x0.astype(np.float64)
    d = x.size
    m = np.zeros(d)
    visits, last, fl = np.zeros(num_clients), {}, []
    for t in range(rounds):
        sampled = sample_clients(seed, t, num_clients, per_round)
        deltas, scores = [], []
        for c in sampled:
            ci = np.full(d, (c + 1) / 10)
            delta = lam * (ci - x) - 0.1 * m
            visits[c] += 1
            last[c] = x + delta
            deltas.append(delta)
            scores.append(np.linalg.norm(ci - x))
        m = beta * m + np.mean(deltas, axis=0)
        x = x + m
        order = np.lexsort((sampled, -np.asarray(scores)))
        selected = np.sort(sampled[order[:2]])
        x = x + np.mean([0.25 * (last[j] - x) for j in selected], axis=0)
        fl.append(4 * (per_round * (2 * d + d + 2) + len(selected) * 2 * d))
    return x, visits, fl


@register
class ToyCrash(Algorithm):
    """FedAvg whose local update raises in round ``crash_round`` (failure-path tests)."""

    name = "toy_crash"
    paper = "test fixture"

    @dataclass(frozen=True)
    class Params(Params):
        crash_round: int = field(default=1, metadata={"doc": "0-based round that fails"})

    def local_update(self, task, payload, client_state, ctx):
        from fedmpi.algorithms import local_sgd

        if ctx.round == self.params.crash_round:
            raise RuntimeError(f"toy crash in client {task.client}")
        return local_sgd.local_update(task, payload["x"], ctx)


@register
class ToyChatty(Algorithm):
    """FedAvg whose local update in round ``chat_round`` writes a line straight to
    descriptors 1 and 2, as a C library's warning does, below Python's streams."""

    name = "toy_chatty"
    paper = "test fixture"

    @dataclass(frozen=True)
    class Params(Params):
        chat_round: int = field(default=2, metadata={"doc": "0-based round that writes"})

    def local_update(self, task, payload, client_state, ctx):
        import os

        from fedmpi.algorithms import local_sgd

        if ctx.round == self.params.chat_round:
            for fd in (1, 2):
                try:
                    os.write(fd, b"a C library's warning, straight to the descriptor\n")
                except OSError:
                    pass
        return local_sgd.local_update(task, payload["x"], ctx)


@register
class ToySlowEval(Algorithm):
    """FedAvg whose model, when it is scored (eval mode) while the file ``marker`` does
    not exist, creates that file and sleeps ``seconds``: a test removes the marker, waits
    for it to come back and then kills a run that is inside its evaluation
    (failure-path tests)."""

    name = "toy_slow_eval"
    paper = "test fixture"

    @dataclass(frozen=True)
    class Params(Params):
        marker: str = field(default="", metadata={"doc": "evaluation is slow while this file is missing"})
        seconds: float = field(default=0.5, metadata={"doc": "sleep per evaluation batch"})

    def build_model(self, build, name, in_channels, num_classes, image_size, options):
        import time
        from pathlib import Path

        model = build(name, in_channels, num_classes, image_size, **options)

        def slow(module, inputs):
            marker = Path(self.params.marker) if self.params.marker else None
            if not module.training and marker is not None and not marker.exists():
                marker.touch()
                time.sleep(self.params.seconds)

        model.register_forward_pre_hook(slow)
        return model

    def local_update(self, task, payload, client_state, ctx):
        from fedmpi.algorithms import local_sgd

        return local_sgd.local_update(task, payload["x"], ctx)
