import torch
from torch import nn

from fedmpi.flat import FlatModel


def small_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.GroupNorm(1, 3), nn.Flatten(), nn.Linear(3 * 4 * 4, 5))


def test_parameters_are_views_of_one_buffer():
    net = small_net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    flat = FlatModel(net)
    assert flat.size == sum(p.numel() for p in net.parameters())
    for name, p in net.named_parameters():
        assert p.data.untyped_storage().data_ptr() == flat.params.untyped_storage().data_ptr()
        assert torch.equal(p.detach(), before[name])


def test_round_trip_through_layout():
    flat = FlatModel(small_net())
    vector = torch.randn(flat.size)
    flat.load(vector)
    sd = flat.state_dict_of(vector)
    for name, p in flat.module.named_parameters():
        assert torch.equal(p.detach(), sd[name])
    offsets = [o for _, _, o in flat.layout_rows()]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_backward_writes_into_flat_grads_and_accumulates():
    flat = FlatModel(small_net())
    x = torch.randn(4, 1, 6, 6)
    flat.zero_grad()
    flat.module(x).sum().backward()
    once = flat.grads.clone()
    assert once.abs().sum() > 0
    flat.module(x).sum().backward()
    assert torch.allclose(flat.grads, 2 * once)
    for p in flat.module.parameters():
        assert p.grad.untyped_storage().data_ptr() == flat.grads.untyped_storage().data_ptr()
    flat.zero_grad()
    assert flat.grads.abs().sum() == 0


def test_a_step_on_the_flat_buffer_moves_the_module():
    flat = FlatModel(small_net())
    x = torch.randn(4, 1, 6, 6)
    out0 = flat.module(x).detach()
    flat.params.add_(1.0)
    assert not torch.allclose(flat.module(x), out0)


def test_channels_last_input_gives_same_gradients():
    flat = FlatModel(small_net())
    x = torch.randn(4, 1, 6, 6)
    flat.zero_grad()
    flat.module(x).square().sum().backward()
    g1 = flat.grads.clone()
    flat.zero_grad()
    flat.module(x.contiguous(memory_format=torch.channels_last)).square().sum().backward()
    assert torch.allclose(flat.grads, g1, atol=1e-5)


def test_channels_last_storage_views_and_canonical_order():
    net = small_net()
    reference = {k: v.clone() for k, v in net.state_dict().items()}
    flat = FlatModel(net, channels_last=True)
    conv = flat.module[0].weight
    nhwc = conv.detach().contiguous(memory_format=torch.channels_last).stride()
    assert conv.stride() == nhwc and conv.grad.stride() == nhwc
    for name, p in flat.module.named_parameters():
        assert torch.equal(p.detach(), reference[name])
    canonical = flat.canonical(flat.params)
    standard = torch.cat([reference[n].reshape(-1) for n, _, _ in flat.layout_rows()])
    assert torch.equal(canonical, standard)
    for name, t in flat.state_dict_of(flat.params).items():
        assert torch.equal(t, reference[name])
    x = torch.randn(2, 1, 6, 6)
    flat.zero_grad()
    flat.module(x).sum().backward()
    plain = FlatModel(small_net())
    plain.module(x).sum().backward()
    assert torch.allclose(flat.canonical(flat.grads), plain.grads, atol=1e-6)


def test_host_vectors_start_where_torch_allocations_do():
    """The round's fresh host buffers are numpy's memory (huge pages), but a kernel's
    summation order may depend on where its input starts: each must start on a 64-byte
    boundary, as torch's do, wherever the heap put the array behind it."""
    import numpy as np

    from fedmpi.flat import ALIGN, host_vector

    raw = [np.empty(n, np.float32).ctypes.data % ALIGN for n in range(1, 200)]
    assert any(raw), "numpy's own arrays all start on 64 bytes here: the check below proves nothing"
    for n in [*range(1, 200), 1 << 16, 11_200_000]:
        for zeros in (True, False):
            v = host_vector(n, zeros)
            assert v.dtype == torch.float32 and v.shape == (n,) and v.is_contiguous()
            assert v.data_ptr() % ALIGN == 0, (n, zeros, v.data_ptr() % ALIGN)
            if zeros:
                assert not v.any()
