"""The bare PyTorch loop on a peers workload file: the reference every simulator is timed against.

The loop a researcher writes: one model, ``torch.optim.SGD`` made per client, the
gradient clipped when the workload clips, the global model the sample-weighted mean of
the clients' models. The data is normalised once, in memory.
"""

from __future__ import annotations

import time

import torch

from common import cli, finish, load, loss


def main() -> None:
    args = cli(__doc__)
    w = load(args.workload)
    model = w.build_model()
    params = list(model.parameters())
    global_params = [p.detach().clone() for p in params]
    rounds, steps = [], 0
    for t in range(w.rounds):
        start = time.perf_counter()
        chosen = w.clients[t]
        weights = w.sizes[chosen] / w.sizes[chosen].sum()
        total = [torch.zeros_like(p) for p in params]
        for k in range(len(chosen)):
            with torch.no_grad():
                for p, g in zip(params, global_params):
                    p.copy_(g)
            opt = torch.optim.SGD(params, lr=float(w.lr[t]))
            model.train()
            x, y = w.client_data(t, k)
            for s in range(0, len(y), w.batch_size):
                opt.zero_grad()
                loss(model, x[s:s + w.batch_size], y[s:s + w.batch_size]).backward()
                if w.grad_clip:
                    torch.nn.utils.clip_grad_norm_(params, w.grad_clip)
                opt.step()
                steps += 1
            with torch.no_grad():
                for acc, p in zip(total, params):
                    acc.add_(p, alpha=float(weights[k]))
        global_params = total
        rounds.append(time.perf_counter() - start)
    with torch.no_grad():
        for p, g in zip(params, global_params):
            p.copy_(g)
    finish("bare", args, w, model, rounds, steps)


if __name__ == "__main__":
    main()
