"""Batched augmentation: shape/dtype, determinism, identity when disabled, crop shifts, flip flips."""

import time

import pytest
import torch

from fedmpi.data.augment import augment, to_float

MEAN, STD = (0.25, 0.5, 0.75), (0.2, 0.3, 0.4)


def images(b=8, c=3, h=10, w=12, seed=0):
    return torch.randint(1, 256, (b, c, h, w), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def test_to_float_normalises():
    x = images()
    mean, std = (torch.tensor(v, dtype=torch.float64).view(1, 3, 1, 1) for v in (MEAN, STD))
    expected = (x.double() / 255 - mean) / std
    out = to_float(x, MEAN, STD)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.allclose(out.double(), expected, atol=1e-5)
    assert torch.equal(to_float(x, None, None), to_float(x, (0.0,), (1.0,)))
    assert torch.allclose(to_float(x, None, None), x.float() / 255)


@pytest.mark.parametrize("channels_last", [False, True])
def test_shape_dtype_layout(channels_last):
    g = torch.Generator().manual_seed(0)
    out = augment(images(), g, mean=MEAN, std=STD, channels_last=channels_last)
    assert out.shape == (8, 3, 10, 12) and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last) == channels_last


def test_same_generator_state_same_output():
    x, g = images(), torch.Generator().manual_seed(5)
    state = g.get_state()
    first, second = augment(x, g, mean=MEAN, std=STD), augment(x, g, mean=MEAN, std=STD)
    g.set_state(state)
    assert torch.equal(augment(x, g, mean=MEAN, std=STD), first)
    assert not torch.equal(first, second)  # the generator advanced


def test_identity_when_disabled():
    x = images()
    out = augment(x, torch.Generator(), crop_padding=0, flip=False, mean=MEAN, std=STD)
    assert torch.equal(out, to_float(x, MEAN, STD))


def test_crop_is_a_zero_padded_shift():
    """Every output equals its input shifted by (dy, dx) in [-p, p], zeros where it left the image."""
    x, p = images(b=64, c=1), 3
    out = augment(x, torch.Generator().manual_seed(1), crop_padding=p, flip=False)
    shifts = set()
    for i in range(len(x)):
        matches = [(dy, dx) for dy in range(-p, p + 1) for dx in range(-p, p + 1)
                   if torch.equal(out[i], to_float(shift(x[i:i + 1], dy, dx))[0])]
        assert len(matches) == 1
        shifts.add(matches[0])
    assert len(shifts) > 15  # of the 49 possible


def shift(x, dy, dx):
    """x moved down by dy and right by dx, zero-filled (the reference crop)."""
    out = torch.zeros_like(x)
    h, w = x.shape[-2:]
    out[..., max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
        x[..., max(-dy, 0):h - max(dy, 0), max(-dx, 0):w - max(dx, 0)]
    return out


def test_flip_flips_about_half():
    x = images(b=200)
    out = augment(x, torch.Generator().manual_seed(2), crop_padding=0, flip=True)
    plain, mirrored = to_float(x), to_float(x.flip(-1))
    flipped = [torch.equal(out[i], mirrored[i]) for i in range(len(x))]
    kept = [torch.equal(out[i], plain[i]) for i in range(len(x))]
    assert all(f != k for f, k in zip(flipped, kept))
    assert 60 < sum(flipped) < 140


def best_time(run, repeats=7, calls=50):
    for _ in range(10):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        times.append((time.perf_counter() - start) / calls)
    return min(times), sorted(times)[repeats // 2]


def test_time_per_batch():
    """Printed figures, best and median of 7 repeats: other jobs may share the cores, and
    2-thread torch ops on small tensors are hurt badly by that, 1-thread ones far less."""
    x = torch.randint(0, 256, (50, 1, 28, 28), dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    run = lambda: augment(x, g, mean=(0.286,), std=(0.353,), channels_last=True)  # noqa: E731
    threads = torch.get_num_threads()
    figures = {threads: best_time(run, repeats=5, calls=10)}
    try:
        torch.set_num_threads(1)
        figures[1] = best_time(run)
    finally:
        torch.set_num_threads(threads)
    text = [f"{n} thread(s) best {b * 1e6:.0f} us, median {m * 1e6:.0f} us"
            for n, (b, m) in figures.items()]
    print("\naugment, batch of 50 x 1x28x28 (crop 4 + flip, channels_last): " + "; ".join(text))
    assert min(b for b, _ in figures.values()) < 1.0  # generous: a hang, not a slowdown
