"""Two-view SimCLR augmentation, batched on the device that holds the data.

The pipeline of SimCLR (Chen et al. 2020, https://arxiv.org/abs/2002.05709) as FedU^2's
code applies it per image with torchvision: RandomResizedCrop(scale
``crop_scale``, ratio 3/4-4/3) -> RandomHorizontalFlip -> RandomApply(ColorJitter(
``jitter``), p=``jitter_p``) -> RandomGrayscale(p=``gray_p``) -> [0, 1] floats, no
normalisation. Each of the 2B images (B images x 2 views) draws its own parameters:

- crop: torchvision's rule with its 10 attempts, vectorised (first valid attempt, else the
  centre crop with the ratio clamped); cropping, resizing back to H x W (bilinear,
  align_corners=False, source coordinates clamped to the crop as F.interpolate does) and
  flipping are one ``grid_sample`` over the batch;
- colour jitter: brightness, contrast, saturation and hue factors uniform as torchvision's
  ColorJitter, applied in a random order per image (the 4 x 4 (slot, op) groups are
  indexed, no loop over images); hue is a shift of H in a vectorised RGB -> HSV -> RGB
  (torchvision's own definition, not a YIQ rotation);
- grayscale: 0.2989 R + 0.587 G + 0.114 B in all three channels.
For 1-channel images grayscale, saturation and hue are no-ops (as in torchvision); their
parameters are still drawn, so the random stream does not depend on the channel count.

Randomness comes only from ``generator`` (drawn on its device, then moved), so the views
are a function of the images and the generator state. Draw order: crop (scale, log-ratio
[2B, 10] each, then row and column offsets [2B] each), flip [2B], jitter on/off [2B],
jitter factors [2B, 4], op order [2B, 4], grayscale [2B]. View 1 is rows 0..B-1.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from fedmpi.errors import UsageError

GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale
RATIO = (3 / 4, 4 / 3)                 # torchvision RandomResizedCrop's default ratio range
ATTEMPTS = 10                          # torchvision's tries before the fallback crop


def two_views(x_uint8: torch.Tensor, generator: torch.Generator, *, crop_scale=(0.2, 1.0),
              jitter=(0.8, 0.8, 0.8, 0.2), jitter_p: float = 0.8, gray_p: float = 0.2,
              flip: bool = True, channels_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [B, C, H, W] -> two independently augmented float32 views in [0, 1]."""
    _check(crop_scale, jitter, jitter_p, gray_p)
    b, _, h, w = x_uint8.shape
    x = x_uint8.to(torch.float32).div_(255)
    crop = crop_params(2 * b, h, w, crop_scale, generator)
    views = resized_crop_flip(torch.cat([x, x]), *crop, _flips(2 * b, flip, generator))
    views = color_jitter(views, jitter, jitter_p, generator)
    views = random_grayscale(views, gray_p, generator)
    first, second = views[:b], views[b:]
    if channels_last:
        layout = torch.channels_last
        return first.contiguous(memory_format=layout), second.contiguous(memory_format=layout)
    return first, second


def _check(crop_scale, jitter, jitter_p, gray_p) -> None:
    lo, hi = crop_scale
    if not 0 < lo <= hi <= 1:
        raise UsageError(f"crop_scale={tuple(crop_scale)}: need 0 < low <= high <= 1")
    if len(jitter) != 4 or min(jitter) < 0 or jitter[3] > 0.5:
        raise UsageError(f"jitter={tuple(jitter)}: need 4 values >= 0 "
                         "(brightness, contrast, saturation, hue) with hue <= 0.5")
    for name, p in (("jitter_p", jitter_p), ("gray_p", gray_p)):
        if not 0 <= p <= 1:
            raise UsageError(f"{name}={p}: must be in [0, 1]")


def _uniform(shape, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=generator, device=generator.device)


def _flips(n: int, flip: bool, generator: torch.Generator) -> torch.Tensor:
    if not flip:
        return torch.zeros(n, dtype=torch.bool, device=generator.device)
    return torch.rand(n, generator=generator, device=generator.device) < 0.5


def crop_params(n: int, h: int, w: int, scale, generator: torch.Generator):
    """torchvision RandomResizedCrop.get_params for n images: (top, left, height, width) [n]."""
    area = h * w
    target = area * _uniform((n, ATTEMPTS), scale[0], scale[1], generator)
    ratio = torch.exp(_uniform((n, ATTEMPTS), math.log(RATIO[0]), math.log(RATIO[1]), generator))
    cw = torch.sqrt(target * ratio).round()
    ch = torch.sqrt(target / ratio).round()
    ok = (cw > 0) & (cw <= w) & (ch > 0) & (ch <= h)
    first = ok.to(torch.int8).argmax(dim=1, keepdim=True)  # first valid attempt
    found = ok.any(dim=1)
    fw, fh = _fallback(h, w)
    cw = torch.where(found, cw.gather(1, first)[:, 0], torch.full_like(cw[:, 0], fw))
    ch = torch.where(found, ch.gather(1, first)[:, 0], torch.full_like(ch[:, 0], fh))
    top_u, left_u = (torch.rand(n, generator=generator, device=generator.device) for _ in range(2))
    top = torch.where(found, (top_u * (h - ch + 1)).floor(), ((h - ch) / 2).floor())
    left = torch.where(found, (left_u * (w - cw + 1)).floor(), ((w - cw) / 2).floor())
    return top, left, ch, cw


def _fallback(h: int, w: int) -> tuple[float, float]:
    """torchvision's centre-crop size (width, height) when no attempt fits."""
    in_ratio = w / h
    if in_ratio < RATIO[0]:
        return float(w), float(round(w / RATIO[0]))
    if in_ratio > RATIO[1]:
        return float(round(h * RATIO[1])), float(h)
    return float(w), float(h)


def _source_coords(start, size, out: int) -> torch.Tensor:
    """Source pixel coordinate of each output pixel, [n, out]: F.interpolate's bilinear
    rule (align_corners=False) inside [start, start + size), clamped to it."""
    dst = torch.arange(out, device=start.device, dtype=torch.float32) + 0.5
    src = start[:, None] + dst[None, :] * (size[:, None] / out) - 0.5
    return torch.minimum(torch.maximum(src, start[:, None]), (start + size - 1)[:, None])


def resized_crop_flip(x: torch.Tensor, top, left, height, width, flipped) -> torch.Tensor:
    """Crop [top, top+height) x [left, left+width) of each image, resize to H x W
    (bilinear), mirror where ``flipped``: one grid_sample. Parameters are [n] tensors."""
    n, _, h, w = x.shape
    top, left, height, width = (t.to(device=x.device, dtype=torch.float32)
                                for t in (top, left, height, width))
    rows = _source_coords(top, height, h)
    cols = _source_coords(left, width, w)
    cols = torch.where(flipped.to(x.device)[:, None], cols.flip(1), cols)
    gx = (2 * cols + 1) / w - 1   # pixel index -> grid_sample's [-1, 1] (align_corners=False)
    gy = (2 * rows + 1) / h - 1
    grid = torch.stack([gx[:, None, :].expand(n, h, w), gy[:, :, None].expand(n, h, w)], dim=-1)
    return F.grid_sample(x, grid.to(x.dtype), mode="bilinear", padding_mode="border",
                         align_corners=False)


def grayscale(x: torch.Tensor) -> torch.Tensor:
    """[n, 1, H, W] luminance of RGB images (the image itself for 1 channel)."""
    if x.shape[1] == 1:
        return x
    r, g, b = x.unbind(dim=1)
    return (GRAY_WEIGHTS[0] * r + GRAY_WEIGHTS[1] * g + GRAY_WEIGHTS[2] * b).unsqueeze(1)


def _blend(x: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """torchvision's _blend for floats: (f x + (1 - f) other).clamp(0, 1), f per image."""
    f = factor.view(-1, 1, 1, 1)
    return (f * x + (1 - f) * other).clamp(0, 1)


def adjust_brightness(x, factor):
    return _blend(x, torch.zeros_like(x), factor)


def adjust_contrast(x, factor):
    return _blend(x, grayscale(x).mean(dim=(1, 2, 3), keepdim=True), factor)


def adjust_saturation(x, factor):
    return x if x.shape[1] == 1 else _blend(x, grayscale(x), factor)


def adjust_hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Shift the hue of RGB images by ``shift`` [n] (fraction of a turn), via HSV."""
    if x.shape[1] == 1:
        return x
    h, s, v = rgb_to_hsv(x).unbind(dim=1)
    h = torch.remainder(h + shift.view(-1, 1, 1), 1.0)
    return hsv_to_rgb(h, s, v)


def rgb_to_hsv(x: torch.Tensor) -> torch.Tensor:
    """torchvision's _rgb2hsv: [n, 3, H, W] RGB in [0, 1] -> HSV with H in [0, 1)."""
    r, g, b = x.unbind(dim=1)
    maxc, minc = x.max(dim=1).values, x.min(dim=1).values
    equal = maxc == minc
    chroma = maxc - minc
    ones = torch.ones_like(maxc)
    s = chroma / torch.where(equal, ones, maxc)
    divisor = torch.where(equal, ones, chroma)
    rc, gc, bc = ((maxc - c) / divisor for c in (r, g, b))
    hr = (maxc == r) * (bc - gc)
    hg = ((maxc == g) & (maxc != r)) * (2.0 + rc - bc)
    hb = ((maxc != g) & (maxc != r)) * (4.0 + gc - rc)
    h = torch.fmod((hr + hg + hb) / 6.0 + 1.0, 1.0)
    return torch.stack((h, s, maxc), dim=1)


def hsv_to_rgb(h: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HSV [n, H, W] each -> RGB [n, 3, H, W]: channel c = v - v s clamp(min(k, 4 - k), 0, 1)
    with k = (m_c + 6h) mod 6, m = (5, 3, 1); the closed form of torchvision's six-sector
    _hsv2rgb (equal to ~1e-6) without its 6 x 3 stack."""
    m = torch.arange(5, 0, -2, device=h.device, dtype=h.dtype).view(1, 3, 1, 1)  # 5, 3, 1
    k = torch.remainder(m + 6 * h[:, None], 6)
    return v[:, None] - (v * s)[:, None] * torch.minimum(k, 4 - k).clamp(0, 1)


_OPS = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)


def jitter_params(n: int, jitter, jitter_p: float, generator: torch.Generator):
    """(on [n] bool, factors [n, 4], order [n, 4]) as torchvision ColorJitter.get_params:
    factors uniform in [max(0, 1 - j), 1 + j] (hue: [-j, j]), ops in a random order."""
    on = torch.rand(n, generator=generator, device=generator.device) < jitter_p
    u = torch.rand(n, 4, generator=generator, device=generator.device)
    low, high = _jitter_range(tuple(jitter), u.device)
    order = torch.rand(n, 4, generator=generator, device=generator.device).argsort(dim=1)
    return on, low + (high - low) * u, order


@lru_cache(maxsize=16)
def _jitter_range(jitter: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(low [4], high [4]) of the jitter factors, copied to ``device`` once per setting
    instead of once per batch (a host -> device copy; read-only, so safe to share)."""
    low = torch.tensor([max(0.0, 1 - j) for j in jitter[:3]] + [-jitter[3]])
    high = torch.tensor([1 + j for j in jitter[:3]] + [jitter[3]])
    return low.to(device), high.to(device)


def color_jitter(x: torch.Tensor, jitter, jitter_p: float,
                 generator: torch.Generator) -> torch.Tensor:
    """RandomApply(ColorJitter(*jitter), p=jitter_p), each image its own factors and order.

    On a GPU each (slot, op) runs on the whole batch and a mask keeps it for the group's
    images: gathering the group would make the host wait for its size (a sync, up to 16
    per batch). On the CPU nothing waits, so only the group is touched (about a fifth of
    the work). Per image the result is the same either way.
    """
    params = jitter_params(x.shape[0], jitter, jitter_p, generator)
    on, factors, order = (t.to(x.device) for t in params)
    x = x if x.is_cuda else x.clone()
    for slot in range(4):
        for op in range(4):
            if jitter[op] == 0:  # torchvision skips a zero component
                continue
            chosen = on & (order[:, slot] == op)
            if x.is_cuda:
                x = torch.where(chosen.view(-1, 1, 1, 1), _OPS[op](x, factors[:, op]), x)
                continue
            idx = torch.nonzero(chosen).flatten()  # host sync: CPU tensors only, nothing waits
            if idx.numel():
                x[idx] = _OPS[op](x[idx], factors[idx, op])
    return x


def random_grayscale(x: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    """RandomGrayscale(p): luminance in every channel, per image with probability p."""
    chosen = (torch.rand(x.shape[0], generator=generator, device=generator.device) < p).to(x.device)
    if x.shape[1] == 1:
        return x
    return torch.where(chosen.view(-1, 1, 1, 1), grayscale(x).expand_as(x), x)
