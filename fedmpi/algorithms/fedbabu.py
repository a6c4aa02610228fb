"""FedBABU: Towards Enhanced Representation for Federated Image Classification.

Oh, Kim, Yun, ICLR 2022, https://arxiv.org/abs/2106.06042

FedAvg of the body only: the head stays at its random initial values on every client
and in the global model (it is frozen in every local update, so it never changes and
never travels), and personalisation is fine-tuning the whole model at evaluation
(``eval.client_finetune_epochs``, the paper's 5 epochs; per-client evaluation,
fedmpi.runtime.client_eval). Messages: the body's values down and up
(fedmpi.runtime.partial).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import group_sgd, local_sgd
from .base import Upload, register
from .params import Params
from .private import PrivateLayers, body_layers, head_layers, span


@register
class FedBABU(PrivateLayers):
    name = "fedbabu"
    paper = "Oh et al. 2022, arXiv:2106.06042"
    private_state = False   # the head: the initial model's on every client, always
    personalised = False    # its personal model is the global one fine-tuned

    @dataclass(frozen=True)
    class Params(Params):
        pass

    def private_layers(self, module):
        return head_layers(module)

    def local_update_group(self, tasks, payload, client_states, ctx):
        """The group form: every row (its client's merged model) steps its body only."""
        flat = tasks[0].model
        return group_sgd.local_update(tasks, payload["x"], ctx,
                                      trainable=span(flat, body_layers(flat.module)))

    def local_update(self, task, payload, client_state, ctx):
        x, flat = payload["x"], task.model
        flat.load(x)
        loss, steps = local_sgd.train(task, ctx, trainable=span(flat, body_layers(flat.module)))
        return Upload(delta=flat.params - x, num_samples=task.data.num_samples, loss=loss,
                      steps=steps)
