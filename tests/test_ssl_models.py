"""SSL network: shapes, no classifier parameters, contiguous groups in the flat buffer,
BYOL's target copy laid out as the online prefix, validation."""

import pytest
import torch
from torch import nn

from fedmpi.algorithms.ssl_losses import ema_update
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.models.ssl import SSLNet, build_ssl_model, group_slices


def small(predictor=True, norm="layer", seed=0):
    torch.manual_seed(seed)
    return build_ssl_model("cnn", 1, 28, proj_dim=16, predictor=predictor, hidden=32,
                           pred_hidden=8, norm=norm)


def test_shapes_and_no_classifier_parameters():
    model = small()
    x = torch.rand(4, 1, 28, 28)
    assert model.encode(x).shape == (4, 512)
    z = model.project(x)
    assert z.shape == (4, 16) and torch.equal(model(x), z)
    assert model.predict(z).shape == (4, 16)
    assert torch.equal(model.encoder(x), model.encode(x))  # classifier is the identity
    assert not any("classifier" in name for name, _ in model.named_parameters())


def test_head_sizes_by_hand():
    """Projector 512->32->16 (+ LayerNorm(32)), predictor 16->8->16 (+ LayerNorm(8))."""
    with_norm, without = small(norm="layer"), small(norm="none")
    sizes = {g: s.stop - s.start for g, s in group_slices(with_norm).items()}
    assert sizes["projector"] == 512 * 32 + 32 + 2 * 32 + 32 * 16 + 16
    assert sizes["predictor"] == 16 * 8 + 8 + 2 * 8 + 8 * 16 + 16
    bare = {g: s.stop - s.start for g, s in group_slices(without).items()}
    assert bare["projector"] == sizes["projector"] - 64
    assert bare["predictor"] == sizes["predictor"] - 16
    assert not any(isinstance(m, nn.LayerNorm) for m in without.modules())


def test_groups_are_contiguous_slices_of_the_flat_buffer():
    model = small()
    slices = group_slices(model)
    assert list(slices) == ["encoder", "projector", "predictor"]
    assert slices["encoder"].start == 0 and slices["encoder"].stop == slices["projector"].start
    assert slices["projector"].stop == slices["predictor"].start
    flat = FlatModel(model)
    assert slices["predictor"].stop == flat.num_params
    expected = torch.cat([p.detach().flatten() for p in model.predictor.parameters()])
    assert torch.equal(flat.params[slices["predictor"]], expected)
    assert not list(model.buffers())


def test_target_copy_is_the_online_prefix_and_takes_flat_ema():
    model = small()
    target = model.target_copy()
    assert model.predictor is not None and target.predictor is None
    assert all(not p.requires_grad for p in target.parameters())
    online, tflat = FlatModel(model), FlatModel(target)
    prefix = group_slices(model)["projector"].stop
    assert tflat.num_params == prefix and torch.equal(tflat.params, online.params[:prefix])
    online.params.add_(1.0)
    ema_update(tflat.params, online.params[:prefix], 0.75)
    x = torch.rand(2, 1, 28, 28)
    assert torch.allclose(tflat.params, online.params[:prefix] - 0.75)
    first = next(target.parameters())  # the module's tensors are views of the flat buffer
    assert torch.equal(first.flatten(), tflat.params[:first.numel()])
    assert target.project(x).shape == (2, 16)


def test_building_is_seeded_by_the_global_generator():
    a, b = FlatModel(small(seed=3)), FlatModel(small(seed=3))
    assert torch.equal(a.params, b.params)


def test_resnet_backbone():
    torch.manual_seed(0)
    model = build_ssl_model("resnet18", 3, 32, {"num_groups": 2}, proj_dim=8, hidden=16)
    assert model.encode(torch.rand(2, 3, 32, 32)).shape == (2, 512)
    assert model.predictor is None
    with pytest.raises(RuntimeError, match="predictor"):
        model.predict(torch.rand(2, 8))


def test_validation_names_the_field():
    with pytest.raises(UsageError, match="text"):
        build_ssl_model("lstm", 1, 28)
    with pytest.raises(UsageError, match="channels"):
        build_ssl_model("cnn", 1, 28, {"channels": (0, 1)})
    with pytest.raises(UsageError, match="norm"):
        SSLNet(nn.Identity(), 4, norm="batch")
    with pytest.raises(UsageError, match="hidden"):
        SSLNet(nn.Identity(), 4, hidden=0)
