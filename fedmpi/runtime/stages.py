"""Client stages: what happens to a client's upload between its local update and the
aggregator, on the worker that trained it, in the order of ``client_stages``.

A stage may keep per-client state (``state_sizes``: stored, spilled and checkpointed
with the algorithm's client state), change the upload (``upload``: what the server
decodes), change the contribution that is summed (``contribute``), add vectors of its own
to the sums (``sums``: extra summed values, which the server stages see and the server
then takes out before the algorithm's server update) and turn those into round
diagnostics on the server (``summarize``). Values a server stage sends down with the
payload reach the client stages through ``receive``; what a stage adds to the messages
it declares (``traffic``) and the ledger counts. A stage that does nothing to a run is not in the list, or is an
identity: a run without compression, staleness or update statistics folds exactly the
algorithm's contribution.

The order is fixed: the codec first (everything after sees what the server decodes), then
the algorithm's ``contribution``, then the stages that act on it.
"""

from __future__ import annotations

import numpy as np

from .compression import Compression
from .stats import STAT_SIZES_KEYS, stat_contribution, update_statistics


class ClientStage:
    """The identity stage; subclasses override what they do."""

    personalised = False   # True: ``personal`` gives each client a model of its own
    client_fields: list[str] = []   # /clients columns of its own (``columns``)

    def compact(self, payload: dict) -> dict:
        """Server, before the payload is encoded: what of it travels (private layers:
        the shared coordinates of x)."""
        return payload

    def prepare(self, payload: dict, state: dict | None) -> dict:
        """Worker, before a client's local update: the payload the method sees for this
        client (``state``: the client's stored state, host arrays, or None)."""
        return payload

    def restore(self, sums: dict) -> None:
        """Server, before the method's update: the sums back to the method's widths."""

    def personal(self, state: dict | None, x):
        """A client's model for evaluation from its state and the global model x."""
        return x

    def state_sizes(self) -> dict[str, int]:
        """Per-client state this stage keeps, name -> values."""
        return {}

    def sums(self, p: int, d: int) -> dict[str, int]:
        """Extra vectors this stage adds to phase p's sums, name -> values."""
        return {}

    def receive(self, values: dict) -> None:
        """Worker, before the round's clients train: the values the server stages sent
        with the payload this round (``ServerStage.download``), name -> tensor."""

    def traffic(self, p: int) -> tuple[int, int]:
        """Values this stage adds to one participation's messages in phase p (down, up),
        which the ledger counts at 4 bytes each."""
        return 0, 0

    def upload(self, upload, state: dict | None, key: tuple[int, int, int]):
        """(the upload as the server will see it, this client's new state values)."""
        return upload, {}

    def contribute(self, contribution: dict, upload, meta: dict) -> dict:
        """The contribution to sum; ``meta``: the phase's index (``phase``) and what the
        participation says of this client (``scale``: its update's weight)."""
        return contribution

    def summarize(self, p: int, sums: dict, gathered: dict) -> dict:
        """Server: round diagnostics from this stage's extra sums and the client rows."""
        return {}

    def columns(self, clients: np.ndarray) -> dict:
        """Server: this stage's /clients values for a phase's participants (``clients``,
        ascending id)."""
        return {}


class Encode(ClientStage):
    """``[compression]``: the upload as the server decodes it, and the error-feedback
    vectors each client keeps (fedmpi.runtime.compression)."""

    def __init__(self, codecs: Compression):
        self.codecs = codecs

    def state_sizes(self) -> dict[str, int]:
        return self.codecs.state_sizes()

    def upload(self, upload, state, key):
        return self.codecs.upload(upload, state, key)


class Staleness(ClientStage):
    """FedBuff: a stale update's delta weighted by s(tau), which the asynchronous
    participation hands each client (fedmpi.runtime.asyncfl)."""

    def contribute(self, contribution, upload, meta):
        scale = meta.get("scale", 1.0)
        if scale == 1.0:
            return contribution
        return {**contribution, "delta": contribution["delta"] * scale}


class UpdateStatistics(ClientStage):
    """The round's update statistics (fedmpi.runtime.stats): the mean client update norm
    always; with ``eval.update_stats`` the mean pairwise cosine and the local consistency,
    from two extra summed vectors in the first phase."""

    def __init__(self, sums: bool):
        self.on = sums

    def sums(self, p, d):
        return {key: d for key in STAT_SIZES_KEYS} if p == 0 and self.on else {}

    def contribute(self, contribution, upload, meta):
        if not self.on or meta["phase"]:
            return contribution
        return {**contribution, **stat_contribution(upload.delta)}

    def summarize(self, p, sums, gathered):
        if p:
            return {}
        return update_statistics(gathered["update_norm"], *[sums[k] for k in STAT_SIZES_KEYS
                                                            if k in sums])


def client_stages(config, codecs: Compression, private: ClientStage | None = None
                  ) -> list[ClientStage]:
    """The run's client stages, in order: the private layers' split first
    (fedmpi.runtime.partial: everything after sees only what travels), an attack's
    poisoning (fedmpi.runtime.attacks: what a malicious client sends), privacy's clip
    (fedmpi.runtime.dp: it bounds what the client computed), then the codec, the
    staleness weight and the update statistics."""
    from . import attacks, dp   # deferred: their stages subclass ClientStage (a cycle)
    stages: list[ClientStage] = [*([private] if private else []),
                                 *attacks.attack_stages(config), *dp.client_stages(config),
                                 Encode(codecs)]
    m = config.system_model
    if m.profiles != "off" and m.policy == "fedbuff":
        stages.append(Staleness())
    stages.append(UpdateStatistics(config.eval.update_stats))
    return stages


def state_sizes(alg, d: int, stages) -> dict[str, int]:
    """Each client's persistent state: the algorithm's, then the stages' (the codecs' error
    feedback), in that order."""
    sizes = dict(alg.client_state_sizes(d))
    for stage in stages:
        sizes.update(stage.state_sizes())
    return sizes
