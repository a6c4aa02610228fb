"""Flat parameter and gradient buffers over an ``nn.Module``.

Every parameter of the module is re-pointed at a slice of one contiguous tensor
(``params``) and every gradient at a slice of another (``grads``). Loading the global
model is one copy, a client's update is one subtraction, norms and inner products are
one call, and MPI sends the buffer itself. Autograd accumulates into existing ``.grad``
tensors in place, so backward writes straight into ``grads``; ``zero_grad`` is one
``zero_()``.

With ``channels_last`` the 4-D (convolution) weights are stored NHWC inside the flat
buffer, so the module's weights are channels_last views and convolutions run in the
NHWC kernels (1.3x faster per step on CPU, benchmarks/layout.py; for 1-channel inputs
the weights' layout is what selects the kernel). Every vector that leaves the process
for a file goes through ``canonical`` first: files always hold the standard (NCHW,
contiguous) order that ``layout`` describes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

WIRE_BYTES = 4  # float32: the bytes one value of a message takes on the simulated wire
ALIGN = 64      # bytes: where torch's CPU allocations start, and so host_vector's


def host_vector(n: int, zeros: bool = True) -> torch.Tensor:
    """A new float32 [n] in host memory (zeros, or contents undefined), for the buffers a
    round makes afresh: the broadcast's receive buffer, the sums, the server's total.

    numpy's memory, not torch's: numpy asks the kernel for huge pages for large arrays,
    where a torch allocation is faulted in 4 KiB at a time (unless THP_MEM_ALLOC_ENABLE
    was set before torch started). At ResNet-18's 11.2M values, zeros and five additions
    took 0.052 s this way against 0.072 s with ``torch.zeros`` (one thread, 2-core Xeon).
    The vector starts on a 64-byte boundary, as torch's allocations do (numpy's may start
    anywhere on 16): a kernel's summation order may depend on where its input starts,
    and the bits must not depend on where the allocator put a buffer."""
    spare = ALIGN // 4
    raw = np.zeros(n + spare, np.float32) if zeros else np.empty(n + spare, np.float32)
    start = (-raw.ctypes.data % ALIGN) // 4
    return torch.from_numpy(raw[start:start + n])


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def within(self, layers) -> bool:
        """Whether this slot belongs to one of ``layers`` (module names, or slot names)."""
        return any(self.name == n or self.name.startswith(n + ".") for n in layers)


class FlatModel:
    """Owns ``module``'s parameters as views into ``params``; gradients into ``grads``.

    Buffers (if a model has any) are appended to the flat state after the parameters
    so that they travel and aggregate with it; they get no gradient.
    """

    def __init__(self, module: nn.Module, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, channels_last: bool = False):
        self.module = module.to(device=device, dtype=dtype)
        self.channels_last = channels_last
        named = [(n, p) for n, p in self.module.named_parameters()]
        buffers = [(n, b) for n, b in self.module.named_buffers() if b.is_floating_point()]
        self.layout: list[Slot] = []
        offset = 0
        for name, t in named + buffers:
            self.layout.append(Slot(name, tuple(t.shape), offset))
            offset += t.numel()
        self.num_params = sum(p.numel() for _, p in named)
        self.params = torch.empty(offset, device=device, dtype=dtype)
        self.grads = torch.zeros(self.num_params, device=device, dtype=dtype)
        for slot, (_, t) in zip(self.layout, named + buffers):
            self._view(self.params, slot).copy_(t.detach())
        self._repoint(named, buffers)
        self._perm = None

    def _nhwc(self, slot: Slot) -> bool:
        return self.channels_last and len(slot.shape) == 4

    def _view(self, flat: torch.Tensor, slot: Slot) -> torch.Tensor:
        """``flat``'s slice for ``slot`` shaped like the parameter (NHWC strides if 4-D)."""
        piece = flat[slot.offset:slot.offset + slot.numel]
        if self._nhwc(slot):
            o, i, h, w = slot.shape
            return piece.view(o, h, w, i).permute(0, 3, 1, 2)
        return piece.view(slot.shape)

    def _repoint(self, named, buffers):
        for slot, (name, p) in zip(self.layout, named):
            p.data = self._view(self.params, slot)
            p.grad = self._view(self.grads, slot)
        for slot, (name, _) in zip(self.layout[len(named):], buffers):
            owner, attr = _owner(self.module, name)
            owner._buffers[attr] = self._view(self.params, slot)

    @property
    def size(self) -> int:
        """d: the number of values in the flat state (parameters, then float buffers)."""
        return self.params.numel()

    def zero_grad(self) -> None:
        self.grads.zero_()

    def load(self, vector: torch.Tensor) -> None:
        self.params.copy_(vector)

    def canonical(self, vector: torch.Tensor) -> torch.Tensor:
        """A flat vector in this model's storage order -> the standard (NCHW) order."""
        if not any(self._nhwc(s) for s in self.layout):
            return vector
        if self._perm is None:
            index = torch.arange(self.size, dtype=torch.int64)
            self._perm = torch.cat([self._view(index, s).reshape(-1) for s in self.layout])
        return vector[self._perm.to(vector.device)]

    def state_dict_of(self, vector) -> dict[str, torch.Tensor]:
        """Split a flat vector in storage order into named tensors (standard layout)."""
        v = torch.as_tensor(vector)
        return {s.name: self._view(v, s).contiguous() for s in self.layout}

    def layout_rows(self) -> list[tuple[str, tuple[int, ...], int]]:
        """(name, shape, offset) of the standard order, as written to files."""
        return [(s.name, s.shape, s.offset) for s in self.layout]


def _owner(module: nn.Module, dotted: str):
    *path, attr = dotted.split(".")
    for part in path:
        module = getattr(module, part)
    return module, attr
