"""Batched image augmentation on the device that holds the data (the training hot loop).

Images stay uint8 until the last step: random crop with zero padding and horizontal flip
are one gather on bytes, then `to_float` scales and normalises. Randomness comes only
from the `generator` passed in, so a batch's augmentation is a function of that
generator's state (seeded per (seed, round, client) by the caller), wherever it runs.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from fedmpi.errors import UsageError


@lru_cache(maxsize=64)
def _scale_shift(mean, std, channels: int, device: torch.device):
    """(scale, shift) with x * scale + shift == (x / 255 - mean) / std, shaped [1, C, 1, 1]."""
    mean = torch.tensor(mean if mean is not None else (0.0,), dtype=torch.float64)
    std = torch.tensor(std if std is not None else (1.0,), dtype=torch.float64)
    scale, shift = (1 / (255 * std)).expand(channels), (-mean / std).expand(channels)
    return (scale.float().view(1, channels, 1, 1).to(device),
            shift.float().view(1, channels, 1, 1).to(device))


def _key(values):
    """Hashable form of a mean/std (tuple, list or tensor) for the cache."""
    return None if values is None else tuple(float(v) for v in values)


def to_float(x_uint8: torch.Tensor, mean=None, std=None, channels_last: bool = False) -> torch.Tensor:
    """uint8 [B, C, H, W] -> normalised float32 (mean/std per channel of x/255; None = 0/1)."""
    scale, shift = _scale_shift(_key(mean), _key(std), x_uint8.shape[1], x_uint8.device)
    out = x_uint8.to(torch.float32).mul_(scale).add_(shift)
    # converting after the cast measured faster than .to(dtype, memory_format) on CPU
    return out.contiguous(memory_format=torch.channels_last) if channels_last else out


def augment(x_uint8: torch.Tensor, generator: torch.Generator, crop_padding: int = 4,
            flip: bool = True, mean=None, std=None, channels_last: bool = False) -> torch.Tensor:
    """Random crop (zero padding `crop_padding`), random horizontal flip (p=0.5), normalise.

    Offsets and flips are drawn per sample from `generator` (on its own device, then moved),
    and applied as a single gather over the padded batch: no loop over samples.
    """
    if crop_padding == 0 and not flip:
        return to_float(x_uint8, mean, std, channels_last)
    if crop_padding < 0:
        raise UsageError(f"crop_padding={crop_padding}: must be >= 0")
    b, c, h, w = x_uint8.shape
    pad = crop_padding
    offsets = torch.randint(0, 2 * pad + 1, (2, b, 1), generator=generator, device=generator.device)
    rows = offsets[0] + torch.arange(h, device=generator.device)  # [B, H] in padded coordinates
    cols = offsets[1] + torch.arange(w, device=generator.device)  # [B, W]
    if flip:
        flipped = torch.rand(b, 1, generator=generator, device=generator.device) < 0.5
        cols = torch.where(flipped, cols.flip(1), cols)
    source = (rows[:, :, None] * (w + 2 * pad) + cols[:, None, :]).view(b, 1, h * w)
    padded = F.pad(x_uint8, (pad, pad, pad, pad)).reshape(b, c, -1)
    out = padded.gather(2, source.to(x_uint8.device).expand(b, c, h * w)).view(b, c, h, w)
    return to_float(out, mean, std, channels_last)
