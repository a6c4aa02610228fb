"""Tests for fedmpi.models: shapes, the features/classifier contract, parameter counts,
determinism of initialisation, trainability and option validation."""

import pytest
import torch
from torch import nn

from fedmpi import config as cfg
from fedmpi.errors import UsageError
from fedmpi.models import MODELS, build_model, model_options

from conftest import fedmpi

VARIANTS = [
    ("cnn", {}),
    ("cnn", {"padding": "same"}),
    ("resnet18", {"stem": "cifar"}),
    ("resnet18", {"stem": "imagenet"}),
    ("vgg11", {}),
    ("vgg11", {"norm": "group"}),
]
IMAGES = [(1, 28), (3, 32)]  # (in_channels, image_size): MNIST-like and CIFAR-like
IDS = [f"{name}-{'-'.join(map(str, opts.values())) or 'default'}" for name, opts in VARIANTS]


def _build(name, opts, in_channels=3, image_size=32, num_classes=10, seed=0):
    torch.manual_seed(seed)
    return build_model(name, in_channels, num_classes, image_size, **opts)


def _n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("in_channels,image_size", IMAGES)
@pytest.mark.parametrize("name,opts", VARIANTS, ids=IDS)
def test_shapes_and_features_contract(name, opts, in_channels, image_size):
    model = _build(name, opts, in_channels, image_size, num_classes=7).eval()
    x = torch.randn(2, in_channels, image_size, image_size)
    assert isinstance(model.classifier, nn.Linear)
    features = model.features(x)
    assert features.shape == (2, model.classifier.in_features)
    out = model(x)
    assert out.shape == (2, 7)
    assert torch.equal(model.classifier(features), out)


@pytest.mark.parametrize("name,opts", VARIANTS, ids=IDS)
def test_no_buffers_and_no_batchnorm(name, opts):
    model = _build(name, opts)
    assert list(model.buffers()) == []
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize("name,opts,in_channels,image_size,low,high", [
    ("cnn", {}, 3, 32, 0.85e6, 0.92e6),
    ("cnn", {}, 1, 28, 0.57e6, 0.59e6),
    ("cnn", {"padding": "same"}, 1, 28, 1.66e6, 1.67e6),
    ("resnet18", {"stem": "cifar"}, 3, 32, 11.1e6, 11.25e6),
    ("resnet18", {"stem": "imagenet"}, 3, 32, 11.1e6, 11.25e6),
    ("vgg11", {}, 3, 32, 9.7e6, 9.8e6),
])
def test_parameter_counts(name, opts, in_channels, image_size, low, high):
    assert low <= _n_params(_build(name, opts, in_channels, image_size)) <= high


# By hand, 10 classes, channels (32, 64), hidden 512; a 5x5 conv has 25 in c + 1 per output:
#   conv1 25 c 32 + 32 (28x28x1: 832; 32x32x3: 2,432), conv2 25 32 64 + 64 = 51,264,
#   out 512 10 + 10 = 5,130, fc 64 s s 512 + 512 with s the side after two blocks:
#   "valid" (side - 4) // 2 twice: 28 -> 12 -> 4, fc 524,800; 32 -> 14 -> 5, fc 819,712
#   "same"  side // 2 twice:        28 -> 14 -> 7, fc 1,606,144; 32 -> 16 -> 8, fc 2,097,664
@pytest.mark.parametrize("padding,in_channels,image_size,count,flat", [
    ("valid", 1, 28, 582_026, 1024),      # 832 + 51,264 + 524,800 + 5,130
    ("same", 1, 28, 1_663_370, 3136),     # 832 + 51,264 + 1,606,144 + 5,130: the paper's
    ("valid", 3, 32, 878_538, 1600),      # 2,432 + 51,264 + 819,712 + 5,130
    ("same", 3, 32, 2_156_490, 4096),     # 2,432 + 51,264 + 2,097,664 + 5,130
])
def test_cnn_parameter_counts_exactly(padding, in_channels, image_size, count, flat):
    """McMahan et al. 2017's CNN as printed (padded 5x5 convs) and fedmpi's default
    (unpadded, as the PyTorch FL simulators): 1,663,370 and 582,026 parameters on
    28x28x1 with 10 classes."""
    model = _build("cnn", {"padding": padding}, in_channels, image_size)
    assert _n_params(model) == count
    assert model.body[7].in_features == flat
    pad = (2, 2) if padding == "same" else (0, 0)
    assert [m.padding for m in model.body if isinstance(m, nn.Conv2d)] == [pad, pad]


def test_cnn_default_padding_is_the_unpadded_network_bit_for_bit():
    """padding = "valid" is the network fedmpi always built: the same parameters under a
    seed as without the option, and the same outputs (the presets' stored bits)."""
    default, valid = _build("cnn", {}, 1, 28), _build("cnn", {"padding": "valid"}, 1, 28)
    for (name, p), (other, q) in zip(default.named_parameters(), valid.named_parameters(),
                                     strict=True):
        assert name == other and torch.equal(p, q)
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(default(x), valid(x))
    same = _build("cnn", {"padding": "same"}, 1, 28)
    assert same.body[0].weight.shape == default.body[0].weight.shape
    assert not torch.equal(same(x), default(x))


def test_resnet18_imagenet_stem_matches_torchvision_size():
    # torchvision.models.resnet18(num_classes=10) has 11,181,642 parameters; GN has BN's affine count
    assert _n_params(_build("resnet18", {"stem": "imagenet"})) == 11_181_642


def test_resnet18_imagenet_stem_computes_what_torchvision_resnet18_with_gn_computes():
    torchvision = pytest.importorskip("torchvision")
    ours = _build("resnet18", {"stem": "imagenet"}).eval()
    reference = torchvision.models.resnet18(num_classes=10, norm_layer=lambda c: nn.GroupNorm(2, c))
    pairs = list(zip(ours.parameters(), reference.parameters(), strict=True))
    with torch.no_grad():
        for mine, theirs in pairs:
            theirs.copy_(mine)  # same registration order, so same shapes pair up
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(ours(x), reference.eval()(x))


@pytest.mark.parametrize("name,opts", VARIANTS, ids=IDS)
def test_init_is_deterministic_under_a_seed(name, opts):
    a, b, c = (_build(name, opts, seed=s).state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


# full-batch steps on 4 noise images: ResNet's gradient norm (~35) needs a small step
@pytest.mark.parametrize("name,opts,image_size,lr", [
    ("cnn", {}, 16, 0.05),
    ("cnn", {"padding": "same"}, 16, 0.05),
    ("cnn", {"padding": "same"}, 28, 0.05),
    ("resnet18", {"stem": "cifar"}, 16, 0.002),
    ("resnet18", {"stem": "imagenet"}, 32, 0.002),
    ("vgg11", {"dropout": 0.0}, 16, 0.05),
    ("vgg11", {"norm": "group", "dropout": 0.0}, 16, 0.05),
])
def test_sgd_steps_reduce_the_loss(name, opts, image_size, lr):
    model = _build(name, opts, 3, image_size)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, image_size, image_size, generator=gen)
    y = torch.tensor([0, 1, 2, 3])
    losses = []
    for _ in range(6):
        loss = nn.functional.cross_entropy(model(x), y)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_cnn_handles_the_smallest_image_and_rejects_smaller():
    assert build_model("cnn", 1, 10, 16)(torch.randn(1, 1, 16, 16)).shape == (1, 10)
    assert build_model("cnn", 1, 10, 16, padding="same")(torch.randn(1, 1, 16, 16)).shape == (1, 10)
    with pytest.raises(UsageError, match="at least 16x16"):
        build_model("cnn", 1, 10, 15)


def test_channels_last_gives_the_same_outputs():
    model = _build("cnn", {})
    x = torch.randn(2, 3, 32, 32)
    expected = model(x)
    model = model.to(memory_format=torch.channels_last)
    actual = model(x.to(memory_format=torch.channels_last))
    torch.testing.assert_close(actual, expected)


def test_model_options_lists_defaults_that_build_the_default_model():
    assert set(MODELS) == {"cnn", "resnet18", "vgg11", "lstm", "mlp", "2nn"}
    assert model_options("2nn") == {"hidden": (200, 200)}
    assert model_options("cnn") == {"hidden": 512, "channels": (32, 64), "padding": "valid",
                                    "norm": "none"}
    assert model_options("resnet18") == {"num_groups": 2, "stem": "cifar"}
    assert model_options("vgg11") == {"norm": "none", "num_groups": 2, "dropout": 0.5}
    for name in MODELS:
        explicit = _build(name, model_options(name)).state_dict()
        default = _build(name, {}).state_dict()
        assert all(torch.equal(explicit[k], default[k]) for k in default)


@pytest.mark.parametrize("hidden", [(64, 64), (7,), ()])
def test_mlp_features_contract_on_tabular_features(hidden):
    """in_channels is the number of features (Dataset.in_channels for tabular data);
    without hidden layers the features are the inputs (logistic regression)."""
    torch.manual_seed(0)
    model = build_model("mlp", 13, 3, 1, hidden=list(hidden)).eval()
    x = torch.randn(5, 13)
    assert MODELS["mlp"].modality == "tabular" and model_options("mlp") == {"hidden": (64, 64)}
    assert model.features(x).shape == (5, (hidden or (13,))[-1])
    assert torch.equal(model.classifier(model.features(x)), model(x)) and model(x).shape == (5, 3)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [m.out_features for m in linears] == [*hidden, 3] and list(model.buffers()) == []
    assert build_model("mlp", 13, 3, 1, hidden=[8], proj_dim=4).project(torch.randn(2, 8)).shape == (2, 4)


@pytest.mark.parametrize("hidden", [[0], [64, -1], 64, [2.5], [True]])
def test_mlp_hidden_must_be_positive_widths(hidden):
    with pytest.raises(UsageError, match=r"^model.hidden must be a list of positive integers"):
        build_model("mlp", 4, 2, 1, hidden=hidden)


def test_options_change_the_architecture():
    model = _build("cnn", {"hidden": 880, "channels": [16, 32]}, 1, 28)  # a TOML list is accepted
    assert model.classifier.in_features == 880
    assert model.body[0].out_channels == 16
    norms = [m for m in _build("vgg11", {"norm": "group", "num_groups": 4}).modules()
             if isinstance(m, nn.GroupNorm)]
    assert len(norms) == 8 and all(m.num_groups == 4 for m in norms)


def test_unknown_model_name_lists_the_allowed_names():
    with pytest.raises(UsageError, match="model.name must be one of 'cnn', 'resnet18', 'vgg11'"):
        build_model("resnet50", 3, 10, 32)
    with pytest.raises(UsageError, match="model.name"):
        model_options("lenet")


@pytest.mark.parametrize("name,options,field", [
    ("cnn", {"width": 3}, "model.width"),
    ("cnn", {"hidden": 0}, "model.hidden"),
    ("cnn", {"hidden": 2.5}, "model.hidden"),
    ("cnn", {"hidden": True}, "model.hidden"),
    ("cnn", {"channels": (32,)}, "model.channels"),
    ("cnn", {"channels": (32, -1)}, "model.channels"),
    ("cnn", {"padding": "full"}, "model.padding"),
    ("cnn", {"padding": 2}, "model.padding"),
    ("cnn", {"padding": "SAME"}, "model.padding"),
    ("resnet18", {"stem": "tiny"}, "model.stem"),
    ("resnet18", {"num_groups": 3}, "model.num_groups"),
    ("resnet18", {"norm": "group"}, "model.norm"),
    ("vgg11", {"norm": "batch"}, "model.norm"),
    ("vgg11", {"num_groups": 128}, "model.num_groups"),
    ("vgg11", {"dropout": 1.0}, "model.dropout"),
])
def test_bad_options_raise_a_one_line_usage_error_naming_the_field(name, options, field):
    with pytest.raises(UsageError) as info:
        build_model(name, 3, 10, 32, **options)
    message = str(info.value)
    assert message.startswith(field + " ") and "\n" not in message


@pytest.mark.slow
def test_a_bad_cnn_padding_is_one_line_naming_the_allowed_values():
    """`--set model.padding=full`: exit 2, one line naming the field and both values;
    nothing else on stderr."""
    proc = fedmpi(["config", "--set", "model.padding=full"])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "fedmpi: model.padding must be one of 'valid', 'same', got 'full'\n"


def test_the_resolved_padding_is_recorded_in_the_config():
    """Every cnn config says which network ran: "valid" when not given, "same" as given
    (the results file's config is the resolved one: tests/test_client_groups.py runs it)."""
    assert cfg.resolve(overrides=["rounds=1"]).model.options["padding"] == "valid"
    c = cfg.resolve(overrides=['model.padding="same"'])
    assert c.model.options["padding"] == "same" and c.to_dict()["model"]["padding"] == "same"
    assert cfg.resolve(overrides=["model.padding=same"]).model.options["padding"] == "same"
