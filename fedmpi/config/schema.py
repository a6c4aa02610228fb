"""The experiment's configuration as dataclasses: sections, fields, their defaults.

Open sections (``OPEN_SECTIONS``) pass their unknown keys on to what they configure (the
dataset, the partition kind, the model, the algorithm), which checks them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError


@dataclass
class DataConfig:
    dataset: str = "mnist5k"           # see `fedmpi datasets`: synthetic | mnist5k | fashion_mnist |
                                       # mnist | cifar10 | cifar100 | tiny_imagenet | shakespeare |
                                       # arrays (your own .npz/HDF5 file: data.path) | a plugin's
    data_dir: str | None = None        # where the dataset's files are (some sources find their own)
    augment: bool = False              # random crop with padding + horizontal flip, on the device
    crop_padding: int = 4
    flip: bool = True
    public_size: int = 0               # a server-side labelled set (FNR-FL); 0 = none
    public_from: str = "train"         # train: held out before partitioning, disjoint from test;
                                       # test: the first public_size test samples (FNR-FL's paper
                                       # setting; LEAKY: the model then trains on what it is tested on)
    options: dict = field(default_factory=dict)   # dataset-specific (synthetic sizes)


@dataclass
class PartitionConfig:
    kind: str = "iid"                  # iid | dirichlet | pathological | quantity | natural
    params: dict = field(default_factory=dict)    # the kind's parameters, e.g. alpha = 0.3
    # Feature skew, on top of any kind (label + feature = a label kind with these set):
    noise: float = 0.0                 # Gaussian pixel noise (images in [0, 1]); "level": client
                                       # i of K gets std noise * i / (K - 1) (FNR-FL, NIID-Bench)
    noise_mode: str = "level"          # level | space (std = noise only in client i's image block)
    brightness: float = 0.0            # client brightness factor ~ U(1 - b, 1 + b), fixed per client
    saturation: float = 0.0            # client saturation factor ~ U(1 - s, 1 + s) (FedMIM colour skew)
    local_test: float = 0.0            # fraction of each client's samples kept as its local test
                                       # split (stratified by label, keyed by the seed; a client
                                       # of n >= 2 samples keeps 1..n-1 for training); 0 = none


@dataclass
class ClientsConfig:
    num: int = 20                      # N, the client population
    per_round: int = 5                 # S, clients a round trains (bernoulli: the expected number)
    sampling: str = "uniform"          # how S_t is drawn, keyed by (seed, round) alone:
                                       # uniform: S distinct clients, every S-subset equally likely;
                                       # bernoulli: each client independently with probability
                                       # q = per_round / num, so |S_t| ~ Binomial(num, q) varies
                                       # (FL-Simulator, the FedMIM/FedMRUR code); size: S distinct
                                       # clients drawn one by one with probability proportional to
                                       # their sample count among those left (successive sampling:
                                       # inclusion is not exactly proportional to the count)
    empty_rounds: str = "redraw"       # a bernoulli draw of nobody: redraw (draw again from the
                                       # round's stream until someone is in) | skip (the round
                                       # trains nobody: model and server state unchanged, the
                                       # round is still evaluated and its lr still counts)
    holdout: float = 0.0               # fraction of the population's slots never sampled for
                                       # training (keyed; at least 1 when > 0): scored by
                                       # eval.clients as new clients (holdout_*, the
                                       # participation and out-of-sample gaps); 0 = none
    replace_prob: float = 0.0          # dynamic population (FedACG Table 3): every replace_every
    replace_every: int = 0             # rounds each client is replaced with this probability by
                                       # a fresh one (new id, no state, fresh data); 0 = static


@dataclass
class ModelConfig:
    name: str = "cnn"                  # cnn | resnet18 | vgg11 (images), lstm (text), mlp (tabular)
    channels_last: bool = True         # NHWC activations: 1.3x faster convolutions on CPU, and
                                       # client groups on a GPU (see docs/design.md)
    options: dict = field(default_factory=dict)


@dataclass
class AlgorithmConfig:
    name: str = "fedavg"
    params: dict = field(default_factory=dict)


@dataclass
class TrainConfig:
    local_epochs: int = 1              # E
    batch_size: int = 32               # B
    lr: float = 0.05                   # eta_l, local learning rate of round 0
    lr_schedule: str = "exponential"   # eta_l^t over rounds t = 0, 1, ...: exponential (lr *
                                       # lr_decay^t) | step (lr * lr_decay^floor(t / lr_step)) |
                                       # cosine (lr_min + (lr - lr_min)(1 + cos(pi t / rounds)) / 2)
    lr_decay: float = 1.0              # the factor of exponential and step
    lr_step: int = 1                   # step: rounds between two decays
    lr_min: float = 0.0                # cosine: the floor
    warmup_rounds: int = 0             # linear warm-up: eta_l^t times (t + 1) / warmup_rounds
                                       # while t < warmup_rounds
    local_schedule: str = "constant"   # within a client's K local steps k = 0..K-1: constant |
                                       # step (x local_decay after every local epoch, as FedACG's
                                       # code) | cosine (x (1 + cos(pi k / K)) / 2)
    local_decay: float = 1.0           # the factor of local_schedule = step
    local_warmup: int = 0              # linear warm-up over the first local steps of every client
    momentum: float = 0.0              # local SGD momentum (torch.optim.SGD's: on the clipped
                                       # gradient plus weight decay); the buffer starts at 0 in
                                       # every local update (no algorithm keeps it across rounds)
    nesterov: bool = False             # Nesterov momentum (needs momentum > 0)
    optimizer: str = "sgd"             # the local step: sgd (with momentum as above) | adam
                                       # (torch.optim.Adam's step on the clipped gradient plus
                                       # weight decay, L2 as torch's; its moments start at 0
                                       # in every local update, as a new optimizer per round;
                                       # the lr is eta_l of the schedules above)
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])   # adam's (beta1, beta2)
    adam_eps: float = 1e-8             # adam's epsilon, added to the root of the second moment
    weight_decay: float = 0.0
    grad_clip: float = 10.0            # clip each local step's gradient to this L2 norm; 0 = off
                                       # (was clip_norm, still read: RENAMED)
    global_lr: float = 1.0             # eta_g


@dataclass
class EvalConfig:
    every: int = 1                     # evaluate every k rounds (and always the last round)
    at_start: bool = True              # also evaluate the initial model before the first round:
                                       # /rounds row `round = 0` (test metrics only; no training,
                                       # no probes); a resumed run never evaluates it again
    batch_size: int = 0                # also the chunk a worker scores; 0 = auto: 250 when the
                                       # workers run on CPUs (activations stay in cache), 1000 on
                                       # GPUs (the value used is the file's eval_batch_size)
    update_stats: bool = False         # mean pairwise cosine of client updates and local
                                       # consistency per round (two extra d-vectors summed)
    # Self-supervised runs: probes of the global encoder into /eval (expensive; kNN runs on
    # every evaluation round regardless). Any of "linear", "finetune", "spectrum".
    probes: list = field(default_factory=list)
    probe_every: int = 0               # rounds between probes; 0 = after the last round only
    linear_epochs: int = 200           # linear probe: Adam lr 3e-3, batch 512 (FedU^2 code)
    linear_head: str = "raw"           # what the probe sees: raw (FedU^2 code) | standard (each
                                       # feature standardised by the training features' mean, std)
    finetune_epochs: int = 200         # fine-tuning: SGD, batch 128, crop + flip (FedU^2 code)
    finetune_fractions: list[float] = field(default_factory=lambda: [0.01, 0.1])
    finetune_head: str = "raw"         # what the fine-tuning head sees: raw (the encoder's
                                       # features, FedU^2 code; set for ResNet-18's) | l2 (each
                                       # feature row divided by its norm: a CNN without
                                       # normalisation layers collapsed to chance under raw)
    local_spectra: bool = False        # also the spectrum of each client's local model on probe
                                       # rounds (FedU^2 Figure 3's local models), /local_spectra
    # Per-client evaluation on the local test splits (partition.local_test), on every
    # evaluation round: /client_eval rows and client_acc_* summaries in /rounds.
    clients: int | str = "none"        # none | all | N: a keyed sample of N clients (the same
                                       # clients every evaluation)
    client_finetune_epochs: int = 0    # > 0: each evaluated client also fine-tunes the global
                                       # model this many epochs on its local training data (plain
                                       # SGD at train.lr, train.batch_size) and is scored again:
                                       # personal_* (FedAvg-FT); 0 = none
    client_finetune_group: int = 1     # fine-tune in client groups of this size (cut from all
                                       # evaluated clients by step count, placed whole: the
                                       # same bits on any number of ranks; up to float rounding
                                       # against 1, one client after another)


@dataclass
class SystemConfig:
    device: str = "auto"               # auto | cpu | cuda | cuda:N (auto and cuda: one GPU per
                                       # worker, taken in rank order on each node)
    gpu_share: bool = False            # allow more workers than GPUs on a node (they share)
    precision: str = "fp32"            # fp32 | tf32 (TF32 matmuls and convolutions on NVIDIA
                                       # GPUs) | bf16 (forward and loss under bfloat16 autocast,
                                       # FP32 master weights and updates)
    deterministic: bool = False        # bitwise-identical results for any number of ranks
    threads: int = 0                   # torch threads per rank; 0 = auto: a worker takes its
                                       # share of the node's cores (all of them in a single-
                                       # process run), the server 1; deterministic runs: 1
    client_group: int | str = 1        # clients a worker trains in lock-step as one computation
                                       # (vectorised; cross-device FL): 1 = one after another,
                                       # G > 1 = groups of G, "auto" = from the model's size
    state_memory_mb: int = 4096        # client state kept in memory; past it, spilled to disk
    state_dir: str | None = None       # where spilled client state goes (default: a temp dir)
    checkpoint_every: int = 10         # rounds between checkpoints in the results file; 0 = only
                                       # on SIGUSR1/SIGTERM (preemption)


@dataclass
class SystemModelConfig:
    """The simulated deployment's devices and networks (fedmpi.runtime.vclock): off by
    default, and then nothing about a run changes."""
    profiles: str = "off"              # off | lognormal: per-client speed and bandwidths drawn
                                       # from the seed | tiers: each client one of the tiers
                                       # below, drawn by share | file: read from profile_file
    profile_file: str = ""             # profiles file: a .csv (header row) or .npz with columns
                                       # client, speed, down_mbps, up_mbps, latency; every
                                       # client id 0..N-1 of the population exactly once
    tier_names: list = field(default_factory=list)          # profiles tiers: ["low", "high"]
    tier_shares: list[float] = field(default_factory=list)  # each tier's share of the clients
    tier_speeds: list[float] = field(default_factory=list)  # its speed multiplier of step_time
    tier_down_mbps: list[float] = field(default_factory=list)   # its downlink, Mbit/s
    tier_up_mbps: list[float] = field(default_factory=list)     # its uplink, Mbit/s
    step_time: float = 0.05            # seconds one local step (step_unit) takes at speed 1
    step_unit: str = "step"            # step: compute = E ceil(n_i / B) steps x step_time |
                                       # sample: compute = E n_i samples x step_time
    measure_step_time: bool = False    # true: time the model's local steps at start-up on the
                                       # first worker's device instead (stored in the file)
    speed_sigma: float = 1.0           # lognormal sigma of the per-client speed (median 1)
    down_mbps: float = 20.0            # median downlink, Mbit/s
    up_mbps: float = 5.0               # median uplink, Mbit/s
    bandwidth_sigma: float = 1.0       # lognormal sigma of each client's bandwidths
    latency: float = 0.05              # seconds added to every message, each way
    policy: str = "wait_all"           # wait_all | deadline | overselect (synchronous rounds),
                                       # fedasync | fedbuff (asynchronous: a round is one
                                       # server step; fedmpi.runtime.asyncfl)
    deadline: float = 0.0              # policy deadline: seconds a round waits (> 0)
    overselect: float = 0.3            # policy overselect: select ceil(S (1 + e)), keep the
                                       # first S to finish (Bonawitz et al. 2019)
    concurrency: int = 0               # fedasync, fedbuff: clients in flight, C (0: clients.per_round)
    buffer: int = 0                    # fedbuff: arrivals per server step, K <= C (0: C)
    staleness: str = "polynomial"      # async: an update tau server steps stale is weighted
                                       # by s(tau): constant (1) | polynomial ((1 + tau)^-e)
    staleness_exponent: float = 0.5    # e; 0.5 is FedBuff's 1/sqrt(1 + tau)
    mixing: float = 0.6                # fedasync: alpha in x <- (1 - alpha s) x + alpha s x_client
    # Who can be sampled in a round (synchronous policies only; needs profiles):
    availability: str = "always"       # always | bernoulli | markov | diurnal | trace
    availability_p: float = 0.5        # bernoulli: P(available), independently each round
    p_on_off: float = 0.1              # markov: P(on -> off) per round
    p_off_on: float = 0.3              # markov: P(off -> on) per round (starts stationary)
    diurnal_base: float = 0.5          # diurnal: P = clip(base + amplitude sin(2 pi (hour +
    diurnal_amplitude: float = 0.4     # phase_c) / 24), 0, 1), hour the round's virtual start
    availability_file: str = ""        # trace: .csv (header row) or .npz, rows client, start,
                                       # end (virtual seconds): available when start <= t0 < end
    dropout: float = 0.0               # P(a selected client drops out mid-round: it downloads,
                                       # never uploads, is not trained); in [0, 1)


@dataclass
class CompressionConfig:
    """Compressed messages (fedmpi.runtime.compression): off by default, and then nothing
    about a run changes. Bytes in the ledger are the encoded sizes, exactly."""
    up: str = "none"                   # none | fp16 | bf16 | qsgd | topk | randk | sign
    down: str = "none"                 # none | fp16 | bf16 (the payload, cast)
    bits: int = 8                      # qsgd: bits of each value's level (plus a sign bit), 1..16
    bucket: int = 0                    # qsgd: values sharing one norm scale (0: the whole vector)
    fraction: float = 0.01             # topk, randk: k = ceil(fraction n) of n values
    count: int = 0                     # topk, randk: k itself, where > 0 (overrides fraction)
    error_feedback: bool = False       # keep what the codec dropped per client, send it later
    feedback: str = "ef"               # ef (classic, e <- v + e - C(v + e)) | ef21 (g <- g + C(v - g))
    messages: list = field(default_factory=lambda: ["delta"])   # the uploads to compress:
                                       # names the algorithm declares compressible


@dataclass
class PrivacyConfig:
    """User-level differential privacy (fedmpi.runtime.dp, accounting in fedmpi.privacy):
    off by default, and then nothing about a run changes."""
    mechanism: str = "off"             # off | central: DP-FedAvg (McMahan et al. 2018): each
                                       # update clipped to clip, weight 1, Gaussian noise on
                                       # the server's sum, a fixed denominator (per_round)
                                       # | local: each client clips and noises its own update
                                       # | sample: DP-SGD in every local step (per-sample clip)
    local_noise: str = "gaussian"      # local: gaussian (L2 clip, (eps, delta)) | laplace
                                       # (L1 clip, pure eps); std / scale noise_multiplier * clip
    clip: float = 1.0                  # C: each client's update (central, local; L1 under
                                       # Laplace) or each sample's gradient (sample) clipped
                                       # to this norm
    noise_multiplier: float = 0.0      # sigma: noise std sigma C per coordinate of the sum
    target_epsilon: float = 0.0        # > 0: sigma calibrated to this epsilon after `rounds`
                                       # (replaces noise_multiplier; the file records it;
                                       # sample: the smallest client's, at start-up)
    delta: float = 0.0                 # the delta epsilon is reported at; 0: 1 / clients.num^1.1
    accountant: str = "auto"           # auto (pld for central DP under bernoulli sampling with
                                       # noise_multiplier >= 0.3, else rdp) | pld | rdp
    clip_quantile: float = 0.0         # gamma in (0, 1): adaptive clipping (Andrew et al. 2021):
                                       # clip follows this quantile of the update norms from
                                       # a noisy count; 0: the clip stays `clip`
    clip_lr: float = 0.2               # eta_C: C <- C exp(-eta_C (unclipped fraction - gamma))
    count_noise: float = 0.0           # sigma_b: the count's noise std; 0: per_round / 20
    audit_canaries: int = 0            # m > 0: the one-run privacy audit's canary clients
                                       # (fedmpi.audit); its epsilon lower bound after the
                                       # last round, in /rounds


@dataclass
class RobustConfig:
    """Byzantine-robust aggregation (fedmpi.runtime.robust): off by default."""
    aggregator: str = "none"           # none | mean | median | trimmed_mean | krum | multikrum |
                                       # geomed | normbound | bulyan | centered_clip |
                                       # fltrust, in place of the mean of the updates
                                       # (mean: the raw updates' plain mean)
    f: int = 0                         # Byzantine clients assumed a round: krum's, multikrum's
                                       # and bulyan's f, the trimmed mean's cut at each end
    bound: float = 1.0                 # normbound: each update scaled to norm at most this;
                                       # centered_clip: the clipping radius
    cc_iterations: int = 1             # centered_clip: clipping iterations a round
    root_per_class: int = 10           # fltrust: the server's root set, samples of each class
    geomed_iterations: int = 10        # geomed: smoothed Weiszfeld iterations
    geomed_nu: float = 1e-6            # geomed: the smoothing (a distance below it counts as it)


@dataclass
class AttackConfig:
    """Malicious clients (fedmpi.runtime.attacks, .omniscient, .poison): off by default."""
    kind: str = "none"                 # none | sign_flip (-scale Delta) | scale (scale Delta:
                                       # model replacement's boost) | gaussian (N(0, std^2)) |
                                       # alie | ipm | min_max | min_sum (colluding, from the
                                       # benign updates) | label_flip | backdoor (data)
    fraction: float = 0.0              # the keyed share of the population that attacks
    scale: float = 1.0                 # sign_flip, scale: the factor; ipm: epsilon
    std: float = 1.0                   # gaussian: the noise's std per coordinate
    direction: str = "std"             # min_max, min_sum: the perturbation, std | sign | unit
    target: int = -1                   # label_flip: -1 maps y to C - 1 - y, c >= 0 every label
                                       # to c; backdoor: the trigger's label (required)
    trigger: int = 3                   # backdoor: side in pixels of the white square placed
                                       # in each poisoned image's bottom-right corner
    poison_fraction: float = 0.5       # backdoor: the keyed share of a malicious client's
                                       # samples that carry the trigger (and the target label)


@dataclass
class TrackingConfig:
    """Live tracking (rank 0 mirrors every /rounds row); off by default, never needed to
    read a run: the results file is the record, and a tracker that fails only warns."""
    tensorboard: bool = False          # event files (scalars rounds/<column>, step = round)
    tensorboard_dir: str = ""          # "": beside the results file, <file without .h5>.tb/
    mlflow: bool = False               # an MLflow run: the config as parameters, the rows
                                       # as metrics, the results file as an artifact
    mlflow_uri: str = ""               # a tracking URI (a server); "": a local store,
                                       # sqlite:///<results dir>/mlflow.db, no server
    experiment: str = ""               # MLflow experiment / W&B project; "": the config's name
    wandb: bool = False                # a W&B run in offline mode (wandb sync uploads it)


@dataclass
class ExperimentConfig:
    name: str = "experiment"
    seed: int = 0
    rounds: int = 20
    output: str = "runs/{name}-{algorithm}-seed{seed}-{digest}.h5"
    plugins: list = field(default_factory=list)   # modules that register algorithms/models
    data: DataConfig = field(default_factory=DataConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    clients: ClientsConfig = field(default_factory=ClientsConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    system_model: SystemModelConfig = field(default_factory=SystemModelConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def output_path(self) -> Path:
        """``output`` with its placeholders filled in and a leading ``~`` expanded (a TOML
        file has no shell to do it; data paths expand it too)."""
        return Path(self.output.format(**self.placeholders())).expanduser()

    def placeholders(self) -> dict:
        """What ``output`` may name: {name} {algorithm} {dataset} {seed} {digest}."""
        return {"name": self.name, "algorithm": self.algorithm.name,
                "dataset": self.data.dataset, "seed": self.seed, "digest": self.digest()}

    def digest(self) -> str:
        """8 hex digits that differ when the config differs: the sha256 of every value that
        is not the schema's default, ``output`` aside. The default results file name
        carries it, so a second run with other ``--set`` values gets a file of its own
        (it met "results file ... exists"), and the same config the same name (its
        --resume and --force keep working). Fields that keep their default are left out, so
        a field added to the schema later leaves existing configs' names alone."""
        defaults = _flat(ExperimentConfig().to_dict())
        from .since import added_at_default   # deferred: since.py is a leaf, schema a root
        changed = {k: v for k, v in _flat(self.to_dict()).items()
                   if k != "output" and (k not in defaults or defaults[k] != v)
                   and not added_at_default(self.model.name, k, v)}
        text = json.dumps(changed, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    def to_dict(self) -> dict:
        """The resolved config as nested plain data; open sections are flattened back."""
        out = dataclasses.asdict(self)
        for section, extra in OPEN_SECTIONS.items():
            out[section].update(out[section].pop(extra))
        return out


# fields renamed since they were first written: old dotted name -> new. A config given
# the old name (a TOML file, --set, a sweep's axis, a results file written before) means
# the new one; the resolved config, and every file written since, says the new one.
RENAMED = {"train.clip_norm": "train.grad_clip"}   # per-step gradient clipping, not an update's


def renamed(path: list[str]) -> list[str]:
    """A dotted field path under its current name."""
    return RENAMED.get(".".join(path), ".".join(path)).split(".")


def upgrade(values: dict) -> dict:
    """``values`` (plain config data) with renamed fields under their current names: the
    same object where none is there, else a copy. Both names at once is refused."""
    moves = []
    for old, new in RENAMED.items():
        (section, key), (_, key_new) = old.split("."), new.split(".")
        node = values.get(section)
        if isinstance(node, dict) and key in node:
            if key_new in node:
                raise UsageError(f"config field {new}: given also by its old name {old}; "
                                 f"keep one ({new})")
            moves.append((section, key, key_new))
    if not moves:
        return values
    values = {k: dict(v) if isinstance(v, dict) else v for k, v in values.items()}
    for section, key, key_new in moves:
        values[section] = {(key_new if k == key else k): v for k, v in values[section].items()}
    return values


def flatten(config: dict, prefix: str = "") -> dict:
    """Nested config -> {"train.lr": 0.05, ...}; lists stay values (model.channels). Every
    non-empty table is opened, a section's or one inside an open section alike: how runs
    and ranks compare configs key by key (``_flat``, which keeps the tables inside a
    section whole, names the results file)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _flat(values: dict, prefix: str = "") -> dict:
    """Nested sections -> {"train.lr": 0.1, ...}; lists and tables in a value stay whole."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and prefix + key in _SECTIONS:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


# Sections whose unknown keys are passed on (validated by the dataset, model or algorithm).
OPEN_SECTIONS = {"data": "options", "partition": "params", "model": "options", "algorithm": "params"}
_SECTIONS = {f.name for f in dataclasses.fields(ExperimentConfig)
             if dataclasses.is_dataclass(f.default_factory() if callable(f.default_factory) else None)}
