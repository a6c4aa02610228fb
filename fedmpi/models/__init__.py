"""Model registry: `build_model(name, in_channels, num_classes, image_size, **options)`.

Every model exposes `features(x) -> [B, F]` (the penultimate representation, which MOON,
FedMRUR and FNR-FL use), `classifier` (the final nn.Linear) and
`forward(x) == classifier(features(x))`. With the option `proj_dim` > 0 (every model
accepts it) a model also has MOON's projection head `projector` and `project(features)`.
Models use GroupNorm or no normalisation, so they have parameters only and no buffers to
aggregate. Initialisation draws from torch's global generator: seed it
(`torch.manual_seed`) before building. Each model declares the modality of data it takes
("image": float [B, C, H, W]; "text": int64 ids [B, T]; "tabular": float [B, F]);
`check_model_for_data` rejects a mismatch at setup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn

from fedmpi.errors import UsageError, did_you_mean
from fedmpi.models.cnn import CNN, PADDINGS
from fedmpi.models.cnn import NORMS as CNN_NORMS
from fedmpi.models.lstm import CharLSTM
from fedmpi.models.mlp import MLP, TwoNN
from fedmpi.models.resnet import STEMS, WIDTHS, ResNet18
from fedmpi.models.vgg import NORMS, VGG11

__all__ = ["COMMON_OPTIONS", "MODELS", "ModelSpec", "Option", "add_projection_head",
           "build_model", "check_model_for_data", "check_options", "group_problem",
           "model_options"]

Check = Callable[[str, Any], Any]
"""Validates one option value: (field name, value) -> normalised value, or raises UsageError."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(field: str, value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise UsageError(f"{field} must be a positive integer, got {value!r}")
    return value


def non_negative_int(field: str, value: Any) -> int:
    if not _is_int(value) or value < 0:
        raise UsageError(f"{field} must be an integer >= 0, got {value!r}")
    return value


def positive_int_pair(field: str, value: Any) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2 \
            or not all(_is_int(v) and v > 0 for v in value):
        raise UsageError(f"{field} must be two positive integers like [32, 64], got {value!r}")
    return tuple(value)


def positive_int_list(field: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(_is_int(v) and v > 0 for v in value):
        raise UsageError(f"{field} must be a list of positive integers like [64, 64] (or [] "
                         f"for none), got {value!r}")
    return tuple(value)


def one_of(*allowed: str) -> Check:
    def check(field: str, value: Any) -> str:
        if value not in allowed:
            raise UsageError(f"{field} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    return check


def divisor_of_all(widths: tuple[int, ...]) -> Check:
    def check(field: str, value: Any) -> int:
        if not _is_int(value) or value < 1 or any(w % value for w in widths):
            allowed = [g for g in range(1, widths[0] + 1) if all(w % g == 0 for w in widths)]
            raise UsageError(f"{field} must be one of {allowed} (divides every width), got {value!r}")
        return value
    return check


def pad_id(field: str, value: Any) -> int:
    if not _is_int(value) or value < -1:
        raise UsageError(f"{field} must be a token id >= 0, or -1 for no padding, got {value!r}")
    return value


def probability(field: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
        raise UsageError(f"{field} must be a number in [0, 1), got {value!r}")
    return float(value)  # host sync: none, config time (a number)


@dataclass(frozen=True)
class Option:
    """One documented model option: its default, its validator and one line of help."""

    default: Any
    check: Check
    help: str
    # Written out only when given, as COMMON_OPTIONS are: an option added to a model after
    # results files of it existed, so that their configs resolve (and resume) as before.
    when_given: bool = False


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: its class, documented options, the smallest image it accepts
    and the modality of data it takes ("image", "text" or "tabular")."""

    cls: type[nn.Module]
    summary: str
    options: Mapping[str, Option]
    min_image_size: int = 1
    modality: str = "image"


MODELS: dict[str, ModelSpec] = {
    "cnn": ModelSpec(CNN, "McMahan et al. 2017 two-conv CNN: padding 'valid' (default, the "
                          "PyTorch FL simulators' network: 582,026 params on 28x28x1) or 'same' "
                          "(the paper's: 1,663,370 params on 28x28x1)", {
        "hidden": Option(512, positive_int, "width of the hidden fully connected layer"),
        "channels": Option((32, 64), positive_int_pair, "output channels of the two 5x5 convs"),
        "padding": Option("valid", one_of(*PADDINGS),
                          "'valid': unpadded 5x5 convs (the presets' and benchmarks'); "
                          "'same': padded by 2, the paper's TensorFlow network"),
        "norm": Option("none", one_of(*CNN_NORMS),
                       "after each conv: 'batch' (BatchNorm), 'group' (GroupNorm, 2 groups) "
                       "or 'none' (the paper's)"),
    }, min_image_size=16),
    "resnet18": ModelSpec(ResNet18, "ResNet-18 with GroupNorm (11.2M params)", {
        "num_groups": Option(2, divisor_of_all(WIDTHS), "groups of every GroupNorm"),
        "stem": Option("cifar", one_of(*STEMS),
                       "'cifar': 3x3 conv1, no max-pool (FedACG); "
                       "'imagenet': 7x7/2 conv1 + max-pool (torchvision, FedMIM/FedMRUR)"),
    }),
    "vgg11": ModelSpec(VGG11, "VGG-11 with NIID-Bench's 512-512-512 head (9.8M params)", {
        "norm": Option("none", one_of(*NORMS), "normalisation after each conv"),
        "num_groups": Option(2, divisor_of_all(WIDTHS), "GroupNorm groups when norm = 'group'"),
        "dropout": Option(0.5, probability, "dropout before the two hidden linears (NIID-Bench)"),
    }),
    "lstm": ModelSpec(CharLSTM, "LEAF/FedAvg Shakespeare character LSTM (0.82M params); with "
                                "its options LEAF's Sent140 and TFF's StackOverflow networks", {
        "embed_dim": Option(8, positive_int, "token embedding size"),
        "hidden": Option(256, positive_int, "units of each LSTM layer"),
        "layers": Option(2, positive_int, "stacked LSTM layers"),
        "fc": Option(0, non_negative_int, "a linear layer of this width between the LSTM and "
                     "the classifier (LEAF Sent140: 30; TFF StackOverflow: 96); 0 = none",
                     when_given=True),
        "pad_id": Option(-1, pad_id, "inputs right-padded with this id are read after their "
                         "last other id (TFF StackOverflow: 0); -1 = after the last position",
                         when_given=True),
    }, modality="text"),
    "2nn": ModelSpec(TwoNN, "McMahan et al. 2017 2NN: flattened image, 2 hidden layers of 200, "
                            "ReLU (199,210 params on 28x28x1)", {
        "hidden": Option((200, 200), positive_int_list, "widths of the hidden layers"),
    }),
    "mlp": ModelSpec(MLP, "fully connected network with ReLU for tabular features", {
        "hidden": Option((64, 64), positive_int_list,
                         "widths of the hidden layers ([] = logistic regression)"),
    }, modality="tabular"),
}


# Options every model accepts, on top of its own.
COMMON_OPTIONS: dict[str, Option] = {
    "proj_dim": Option(0, non_negative_int,
                       "projection head Linear(F, F) -> ReLU -> Linear(F, proj_dim) on the "
                       "features (MOON uses 256); 0 = no head"),
}


def add_projection_head(module: nn.Module, proj_dim: int) -> None:
    """Attach MOON's projection head as ``module.projector`` [code: QinbinLi/MOON model.py
    ModelFedCon l1, l2]; F = ``classifier.in_features``. It is registered last, so the
    backbone's parameters keep their order and their initial values, and it is part of
    the flat model (aggregated like every other parameter)."""
    f = module.classifier.in_features
    module.projector = nn.Sequential(nn.Linear(f, f), nn.ReLU(), nn.Linear(f, proj_dim))


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise UsageError(f"model.name must be one of {', '.join(map(repr, MODELS))}, got "
                         f"{name!r}{did_you_mean(str(name), MODELS)}")
    return MODELS[name]


def check_model_for_data(name: str, modality: str) -> None:
    """Setup-time check that model `name` takes the dataset's modality ("image" | "text" |
    "tabular")."""
    spec = _spec(name)
    if spec.modality != modality:
        fits = sorted(n for n, s in MODELS.items() if s.modality == modality)
        raise UsageError(f"model.name {name!r} is a{'n' if spec.modality[0] in 'aeiou' else ''} "
                         f"{spec.modality} model but the dataset is {modality}; allowed: "
                         f"{', '.join(map(repr, fits)) or 'none'}")


def model_options(name: str) -> dict[str, Any]:
    """Documented options of model `name` with their defaults (the options every model
    accepts are in COMMON_OPTIONS)."""
    return {key: option.default for key, option in _spec(name).options.items()}


def _resolve(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    spec = _spec(name)
    known = {**spec.options, **COMMON_OPTIONS}
    unknown = sorted(set(options) - set(known))
    if unknown:
        allowed = ", ".join(known)
        raise UsageError(f"model.{unknown[0]} is not an option of model {name!r}"
                         f"{did_you_mean(unknown[0], known)}; allowed: {allowed}")
    resolved = {key: option.check(f"model.{key}", options.get(key, option.default))
                for key, option in spec.options.items()
                if key in options or not option.when_given}
    # Common options are written out only when given: a config without them resolves
    # (and is recorded) exactly as before they existed.
    resolved.update({key: option.check(f"model.{key}", options[key])
                     for key, option in COMMON_OPTIONS.items() if key in options})
    return resolved


def group_problem(name: str, options: Mapping[str, Any]) -> str | None:
    """Why model ``name`` with its resolved ``options`` cannot train in client groups
    (``system.client_group``; fedmpi.algorithms.group_sgd), or None. A group shares the
    module's forward: dropout would draw one mask stream for all its clients, and
    recurrent layers have no batched-weight form under torch.func.vmap."""
    if _spec(name).modality == "text":
        return f"model {name!r} is recurrent and has no group form"
    if options.get("dropout", 0):
        return (f"model {name!r} has dropout (model.dropout = {options['dropout']}), whose masks "
                f"a group would share; set model.dropout = 0")
    return None


def check_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Config-time check of a model name and its options (before any MPI work); returns
    every option of the model with its checked value or default."""
    return _resolve(name, options)


def build_model(name: str, in_channels: int, num_classes: int, image_size: int,
                **options: Any) -> nn.Module:
    """Build model `name` for square images of side `image_size`; unknown options are errors."""
    spec = _spec(name)
    if image_size < spec.min_image_size:
        side = f"{image_size}x{image_size}"
        fits = [n for n, s in MODELS.items()
                if s.modality == spec.modality and s.min_image_size <= image_size]
        raise UsageError(f"model.name {name!r} needs images of at least {spec.min_image_size}x"
                         f"{spec.min_image_size}, got {side}; models for {side}: "
                         f"{', '.join(map(repr, fits)) or 'none'}")
    options = _resolve(name, options)
    proj_dim = options.pop("proj_dim", 0)
    module = spec.cls(in_channels, num_classes, image_size, **options)
    if proj_dim:
        add_projection_head(module, proj_dim)
    return module
