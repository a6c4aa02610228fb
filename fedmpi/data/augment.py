"""Batched image augmentation on the device that holds the data (the training hot loop).

Images stay uint8 until the last step: random crop with zero padding and horizontal flip
are one gather on bytes, then `to_float` scales and normalises. A client's feature skew
(`ClientSkew`: colour factors, Gaussian noise) is applied in between, on [0, 1] floats.
Randomness comes only from the `generator` passed in, so a batch's augmentation is a
function of that generator's state (seeded per (seed, round, client) by the caller),
wherever it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    # host sync: none for the datasets' tuples of floats (a device tensor: one read a channel)
    return None if values is None else tuple(float(v) for v in values)


def to_float(x_uint8: torch.Tensor, mean=None, std=None, channels_last: bool = False) -> torch.Tensor:
    """uint8 [B, C, H, W] -> normalised float32 (mean/std per channel of x/255; None = 0/1)."""
    scale, shift = _scale_shift(_key(mean), _key(std), x_uint8.shape[1], x_uint8.device)
    out = x_uint8.to(torch.float32).mul_(scale).add_(shift)
    # converting after the cast measured faster than .to(dtype, memory_format) on CPU
    return out.contiguous(memory_format=torch.channels_last) if channels_last else out


def augment(x_uint8: torch.Tensor, generator: torch.Generator, crop_padding: int = 4,
            flip: bool = True, mean=None, std=None, channels_last: bool = False) -> torch.Tensor:
    """Random crop (zero padding `crop_padding`), random horizontal flip (p=0.5), normalise."""
    return to_float(crop_flip(x_uint8, generator, crop_padding, flip), mean, std, channels_last)


def crop_flip(x_uint8: torch.Tensor, generator: torch.Generator, crop_padding: int = 4,
              flip: bool = True) -> torch.Tensor:
    """Random crop with zero padding and random horizontal flip, on uint8 images.

    Offsets and flips are drawn per sample from `generator` (on its own device, then moved),
    and applied as a single gather over the padded batch: no loop over samples.
    """
    if crop_padding == 0 and not flip:
        return x_uint8
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
    return padded.gather(2, source.to(x_uint8.device).expand(b, c, h * w)).view(b, c, h, w)


_GRAY = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights


@dataclass(frozen=True)
class ClientSkew:
    """One client's feature skew, applied to every training batch it draws.

    - brightness b, saturation s: fixed factors per client (FedMIM's colour perturbation),
      as torchvision's adjust_brightness (x * b) and adjust_saturation (blend with the
      grey image by s), clamped to [0, 1]; saturation needs 3 channels.
    - noise_std: x + std * N(0, 1) drawn afresh for every batch, unclamped, as NIID-Bench's
      and FNR-FL's AddGaussianNoise on the [0, 1] image; with ``block = (g, i)`` only cell
      i of a g x g grid over the image gets noise (NIID-Bench's "space" mode).
    Colour comes first, then noise, then the dataset's normalisation.
    """

    noise_std: float = 0.0
    brightness: float = 1.0
    saturation: float = 1.0
    block: tuple[int, int] | None = None

    @property
    def is_identity(self) -> bool:
        return self.noise_std == 0 and self.brightness == 1 and self.saturation == 1

    def apply(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """x: float [B, C, H, W] in [0, 1], modified in place and returned."""
        if self.brightness != 1:
            x.mul_(self.brightness).clamp_(0, 1)
        if self.saturation != 1 and x.shape[1] == 3:
            gray = sum(w * x[:, i:i + 1] for i, w in enumerate(_GRAY))
            x.mul_(self.saturation).add_(gray * (1 - self.saturation)).clamp_(0, 1)
        if self.noise_std > 0:
            noise = torch.randn(x.shape, generator=generator, device=generator.device).to(x.device)
            if self.block is not None:
                noise *= self._mask(x.shape[2], x.shape[3], x.device)
            x.add_(noise, alpha=self.noise_std)
        return x

    def _mask(self, h: int, w: int, device) -> torch.Tensor:
        g, i = self.block
        mask = torch.zeros(h, w, device=device)
        bh, bw = max(h // g, 1), max(w // g, 1)
        r, c = (i // g) % g, i % g
        mask[r * bh:(r + 1) * bh, c * bw:(c + 1) * bw] = 1
        return mask


def normalise(x01: torch.Tensor, mean=None, std=None, channels_last: bool = False) -> torch.Tensor:
    """[0, 1] floats -> (x - mean) / std per channel, in place, as `to_float` does for bytes."""
    scale, shift = _scale_shift(_key(mean), _key(std), x01.shape[1], x01.device)
    x = x01.mul_(scale * 255).add_(shift)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def skewed_float(x_uint8: torch.Tensor, skew: ClientSkew, generator: torch.Generator,
                 mean=None, std=None, channels_last: bool = False) -> torch.Tensor:
    """uint8 -> [0, 1] -> the client's skew -> normalised float32 (as `to_float`)."""
    return normalise(skew.apply(x_uint8.to(torch.float32).div_(255), generator), mean, std,
                     channels_last)
