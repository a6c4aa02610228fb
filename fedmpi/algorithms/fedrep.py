"""FedRep: Exploiting Shared Representations for Personalized Federated Learning.

Collins, Hassani, Mokhtari, Shakkottai, ICML 2021, https://arxiv.org/abs/2102.07078

Each client keeps its head; the body (the representation) is shared. A local update of
E = ``train.local_epochs`` epochs first trains the head alone for E - ``rep_epochs``
epochs (the body frozen), then the body alone for ``rep_epochs`` (the head frozen), as
the authors' code does (``local_ep``, ``local_rep_ep``); only the body's change travels.
A client's head starts from the initial model's at its first participation. Messages:
the body's values down and up (fedmpi.runtime.partial).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config.coerce import field_error
from . import group_sgd, local_sgd
from .base import Upload, register
from .params import Params, param
from .private import PrivateLayers, body_layers, head_layers, span


@register
class FedRep(PrivateLayers):
    name = "fedrep"
    paper = "Collins et al. 2021, arXiv:2102.07078"

    @dataclass(frozen=True)
    class Params(Params):
        rep_epochs: int = param(1, ">= 1", "epochs of the body (the representation) at the "
                                           "end of each local update; the head takes the "
                                           "others")

    def private_layers(self, module):
        return head_layers(module)

    def check_training(self, train):
        if train.local_epochs < self.params.rep_epochs:
            raise field_error("algorithm.rep_epochs", f"the body's epochs come out of "
                                                      f"train.local_epochs = "
                                                      f"{train.local_epochs}; must be at most "
                                                      f"that, got {self.params.rep_epochs}")

    def local_update_group(self, tasks, payload, client_states, ctx):
        """The group form: every row (its client's merged model) takes the head's epochs,
        then the body's, from where the first left it, over the same batches as one
        client after another."""
        x, flat = payload["x"], tasks[0].model
        rows, totals, counts = x, [0.0] * len(tasks), [0] * len(tasks)
        head_epochs = ctx.local_epochs - self.params.rep_epochs
        for names, epochs in ((head_layers(flat.module), head_epochs),
                              (body_layers(flat.module), self.params.rep_epochs)):
            if epochs:
                rows, losses, steps = group_sgd.train(
                    tasks, rows, replace(ctx, local_epochs=epochs), trainable=span(flat, names))
                totals = [t + loss * k for t, loss, k in zip(totals, losses, steps)]
                counts = [c + k for c, k in zip(counts, steps)]
        return [Upload(delta=rows[i] - (x if x.dim() == 1 else x[i]),
                       num_samples=t.data.num_samples, loss=totals[i] / max(counts[i], 1),
                       steps=counts[i]) for i, t in enumerate(tasks)]

    def local_update(self, task, payload, client_state, ctx):
        x, flat = payload["x"], task.model
        flat.load(x)
        losses, steps = [], []
        head_epochs = ctx.local_epochs - self.params.rep_epochs
        for names, epochs in ((head_layers(flat.module), head_epochs),
                              (body_layers(flat.module), self.params.rep_epochs)):
            if epochs:
                loss, k = local_sgd.train(task, replace(ctx, local_epochs=epochs),
                                          trainable=span(flat, names))
                losses.append(loss * k)
                steps.append(k)
        return Upload(delta=flat.params - x, num_samples=task.data.num_samples,
                      loss=sum(losses) / max(sum(steps), 1), steps=sum(steps))
