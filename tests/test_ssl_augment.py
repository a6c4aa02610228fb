"""Two-view SSL augmentation: shape/range/layout, determinism, per-sample parameters, and
each stage against torchvision's functional ops on the same parameters."""

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from fedmpi.data.ssl_augment import (adjust_hue, color_jitter, crop_params, jitter_params,
                                     resized_crop_flip, two_views)
from fedmpi.errors import UsageError

OFF = dict(crop_scale=(1.0, 1.0), jitter_p=0.0, gray_p=0.0, flip=False)


def images(b=8, c=3, h=12, w=12, seed=0):
    return torch.randint(0, 256, (b, c, h, w), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("channels_last", [False, True])
def test_shape_dtype_range_layout(channels, channels_last):
    v1, v2 = two_views(images(c=channels), torch.Generator().manual_seed(0),
                       channels_last=channels_last)
    for v in (v1, v2):
        assert v.shape == (8, channels, 12, 12) and v.dtype == torch.float32
        assert v.min() >= 0 and v.max() <= 1
        layout = torch.channels_last if channels_last else torch.contiguous_format
        assert v.is_contiguous(memory_format=layout)
        if channels == 3:  # (for one channel both layouts are the same strides)
            assert v.is_contiguous() != channels_last


def test_same_generator_state_same_views():
    x, g = images(), torch.Generator().manual_seed(5)
    state = g.get_state()
    first = two_views(x, g)
    again = two_views(x, g)
    g.set_state(state)
    replay = two_views(x, g)
    assert all(torch.equal(a, b) for a, b in zip(first, replay))
    assert not torch.equal(first[0], again[0])   # the generator advanced
    assert not torch.equal(first[0], first[1])   # the two views differ


def test_every_sample_draws_its_own_parameters():
    """A batch of one image repeated: the augmented copies differ from each other."""
    x = images(b=1).expand(16, -1, -1, -1).contiguous()
    v1, _ = two_views(x, torch.Generator().manual_seed(1))
    distinct = {tuple(v.flatten()[::7].tolist()) for v in v1}
    assert len(distinct) == 16


def test_everything_off_is_the_identity():
    x = images()
    v1, v2 = two_views(x, torch.Generator().manual_seed(2), **OFF)
    assert torch.allclose(v1, x.float() / 255, atol=1e-6) and torch.allclose(v2, v1)


def test_flip_only_mirrors_about_half():
    x = images(b=64)
    v1, _ = two_views(x, torch.Generator().manual_seed(3), **{**OFF, "flip": True})
    plain, mirrored = x.float() / 255, x.flip(-1).float() / 255
    flipped = [torch.allclose(v1[i], mirrored[i], atol=1e-6) for i in range(64)]
    kept = [torch.allclose(v1[i], plain[i], atol=1e-6) for i in range(64)]
    assert all(f != k for f, k in zip(flipped, kept))
    assert 16 < sum(flipped) < 48


def test_crop_and_flip_match_torchvision():
    x = images(b=4, h=32, w=32).float() / 255
    top, left = torch.tensor([3.0, 0, 5, 10]), torch.tensor([2.0, 7, 0, 1])
    height, width = torch.tensor([20.0, 32, 11, 22]), torch.tensor([25.0, 18, 27, 9])
    flipped = torch.tensor([False, True, False, True])
    out = resized_crop_flip(x, top, left, height, width, flipped)
    for i in range(4):
        ref = TF.resized_crop(x[i], int(top[i]), int(left[i]), int(height[i]), int(width[i]),
                              [32, 32], antialias=False)
        ref = ref.flip(-1) if flipped[i] else ref
        assert torch.allclose(out[i], ref, atol=1e-6)


def test_crop_params_follow_torchvision_rule():
    top, left, h, w = crop_params(4000, 32, 32, (0.2, 1.0), torch.Generator().manual_seed(4))
    assert (h >= 1).all() and (w >= 1).all() and (h <= 32).all() and (w <= 32).all()
    assert (top >= 0).all() and (top + h <= 32).all()
    assert (left >= 0).all() and (left + w <= 32).all()
    area = h * w / 1024
    assert area.min() > 0.15 and area.max() <= 1.0
    ratio = w / h
    assert ratio.min() > 0.6 and ratio.max() < 1.6
    assert (top == 0).any() and (top + h == 32).any()  # both extremes of the offset reachable
    # a 10 x 40 image: no attempt fits at scale 1 -> centre crop with ratio clamped to 4/3
    top, left, h, w = crop_params(5, 10, 40, (1.0, 1.0), torch.Generator().manual_seed(0))
    assert h.tolist() == [10.0] * 5 and w.tolist() == [13.0] * 5 and left.tolist() == [13.0] * 5


def test_color_jitter_matches_torchvision_per_image():
    """Replay the drawn (on, factors, order) with torchvision's functional ops, image by image."""
    x = images(b=24, h=6, w=6, seed=6).float() / 255
    jitter = (0.8, 0.8, 0.8, 0.2)
    state = torch.Generator().manual_seed(7).get_state()
    out = color_jitter(x, jitter, 0.8, torch.Generator().set_state(state))
    on, factors, order = jitter_params(24, jitter, 0.8, torch.Generator().set_state(state))
    ops = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
    assert 0 < on.sum() < 24
    for i in range(24):
        ref = x[i]
        if on[i]:
            for op in order[i].tolist():
                ref = ops[op](ref, float(factors[i, op]))
        assert torch.allclose(out[i], ref, atol=1e-5)


def test_grayscale_always_gives_equal_channels():
    v1, v2 = two_views(images(), torch.Generator().manual_seed(8), gray_p=1.0, jitter_p=0.0)
    for v in (v1, v2):
        assert torch.equal(v[:, 0], v[:, 1]) and torch.equal(v[:, 1], v[:, 2])


def test_colour_ops_are_no_ops_on_one_channel():
    x = images(c=1)
    v1, _ = two_views(x, torch.Generator().manual_seed(9), crop_scale=(1.0, 1.0), flip=False,
                      jitter=(0.0, 0.0, 0.8, 0.2), jitter_p=1.0, gray_p=1.0)
    assert torch.allclose(v1, x.float() / 255, atol=1e-6)


def test_hue_shift_by_a_full_turn_is_the_identity():
    x = images(b=4, h=5, w=5).float() / 255
    assert torch.allclose(adjust_hue(x, torch.full((4,), 0.5)),
                          adjust_hue(adjust_hue(x, torch.full((4,), 0.25)), torch.full((4,), 0.25)),
                          atol=1e-5)
    assert torch.allclose(adjust_hue(x, torch.zeros(4)), x, atol=1e-5)


def test_bad_parameters_name_the_field():
    x, g = images(), torch.Generator()
    with pytest.raises(UsageError, match="crop_scale"):
        two_views(x, g, crop_scale=(0.0, 1.0))
    with pytest.raises(UsageError, match="jitter"):
        two_views(x, g, jitter=(0.8, 0.8, 0.8, 0.7))
    with pytest.raises(UsageError, match="gray_p"):
        two_views(x, g, gray_p=1.5)
