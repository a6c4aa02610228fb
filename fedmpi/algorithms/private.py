"""What the methods with private layers share: the named groups of layers a client may
keep (``resolve``), the runs of coordinates a local update trains (``span``), and the
base class of those methods (``PrivateLayers``). The runtime's side, what travels and
what each client keeps, is fedmpi.runtime.partial."""

from __future__ import annotations

from torch import nn

from ..errors import UsageError
from .fedavg import FedAvg
from .params import param_error

NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
GROUPS = ("head", "body", "norm")


def head_layers(module: nn.Module) -> list[str]:
    """The classifier head (every supervised model's last layer is ``classifier``)."""
    return ["classifier"] if isinstance(getattr(module, "classifier", None), nn.Module) else []


def body_layers(module: nn.Module) -> list[str]:
    """The top-level layers other than the head: the representation."""
    head = head_layers(module)
    return [name for name, _ in module.named_children() if name not in head]


def norm_layers(module: nn.Module) -> list[str]:
    """The normalisation layers (BatchNorm, GroupNorm, LayerNorm), by module name."""
    return [name for name, m in module.named_modules() if isinstance(m, NORMS) and name]


def resolve(names, module: nn.Module) -> list[str]:
    """Module names from a list of names and the groups "head", "body", "norm"."""
    out: list[str] = []
    for name in names:
        group = {"head": head_layers, "body": body_layers, "norm": norm_layers}.get(name)
        if group is not None and not group(module):
            raise UsageError(f"config field algorithm.private: the model has no {name} "
                             f"layers ({type(module).__name__})")
        out += group(module) if group is not None else [name]
    return out


def check_names(names) -> None:
    """Config time: ``algorithm.private`` is a list of layer names (strings)."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
        raise param_error("private", f"must be a list of layer names or of "
                                     f"{', '.join(GROUPS)}, got {names!r}")


def span(flat, names: list[str]) -> tuple[int, int]:
    """The run of parameter coordinates of the layers ``names`` (one contiguous run: the
    head, or the body before it), for ``local_sgd.train``'s ``trainable``."""
    inside = [s for s in flat.layout[:len(list(flat.module.parameters()))] if s.within(names)]
    lo = min(s.offset for s in inside)
    hi = max(s.offset + s.numel for s in inside)
    if sum(s.numel for s in inside) != hi - lo:
        raise UsageError(f"the layers {', '.join(names)} are not one run of the flat model's "
                         f"parameters")
    return lo, hi


class PrivateLayers(FedAvg):
    """FedAvg's server and local update, with the layers ``private_layers`` names kept on
    each client (fedmpi.runtime.partial): only the others travel, and per-client
    evaluation scores each client's own. In a client group each client starts from its
    own merged model (a row of the group's start); a method that changes the local
    update (FedRep's alternation, FedBABU's frozen head) has no group form of it and is
    refused (``Algorithm.trains_in_groups``)."""

    personalised = True
