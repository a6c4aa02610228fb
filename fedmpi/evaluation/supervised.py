"""Test-set evaluation sharded over workers in fixed chunks.

The test set is cut into chunks of ``batch_size`` samples, chunk j goes to worker
j mod W, and each chunk's (correct, loss sum, count) comes back to the server, which
adds them in chunk order. The chunks, and so the sums, do not depend on the number of
workers: accuracy and loss are bitwise identical for any layout.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def chunks_of(num_samples: int, chunk_size: int, worker: int, num_workers: int) -> list[int]:
    num_chunks = -(-num_samples // chunk_size)
    return list(range(worker, num_chunks, num_workers))


@torch.no_grad()
def evaluate_chunks(module, data, chunk_ids: list[int], chunk_size: int) -> np.ndarray:
    """Rows (chunk, correct, loss_sum, count) as float64 for this worker's chunks.

    Each chunk's (correct, loss) stays on the device; the host reads them all at once."""
    module.eval()
    rows = np.zeros((len(chunk_ids), 4))
    n = len(data.test_y)
    sums = []
    for row, j in enumerate(chunk_ids):
        sl = slice(j * chunk_size, min((j + 1) * chunk_size, n))
        logits = module(data.prepare(data.test_x[sl], None))
        y = data.test_y[sl]
        loss = F.cross_entropy(logits, y, reduction="sum")
        correct = (logits.argmax(1) == y).sum()
        sums.append(torch.stack([correct.double(), loss.double()]))  # exact, as float() was
        rows[row, 0], rows[row, 3] = j, len(y)
    if sums:
        rows[:, 1:3] = torch.stack(sums).cpu().numpy()  # host sync: once per evaluation
    return rows


def combine(rows: np.ndarray) -> tuple[float, float]:
    """(accuracy, mean loss) from every worker's chunk rows, summed in chunk order."""
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    correct = loss = count = 0.0
    for _, c, l, k in rows:
        correct += c
        loss += l
        count += k
    return correct / count, loss / count
