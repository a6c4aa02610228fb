"""An experiment's configuration: dataclasses, TOML files, presets and ``--set`` overrides.

Precedence is command line > config file or preset > defaults. Validation happens here,
before any MPI work, and every problem is a one-line ``UsageError`` that names the
field (``train.lr``) and what is allowed. Beyond each field's own range, every number
anywhere in a config is finite (NaN never; infinity only for FedU's ``algorithm.mu``),
every integer at most 2**62 in size (``seed``: 0 to 2**64 - 1) and every string free of
control characters (``check_scalar``); docs/hostile-inputs.md lists the cases. The
resolved config is a plain nested dict (``to_dict``) that the results file stores as JSON.

Modules: ``schema`` (the dataclasses), ``coerce`` (TOML values -> typed fields,
``check_scalar``), ``validate`` (``from_dict``: checks, and the defaults filled in),
``sources`` (files, presets, ``--set``; ``resolve``), ``toml`` (back to TOML, by tomli_w).

Sections of a TOML file (every key optional)::

    name, seed, rounds, output, plugins (modules to import: your own algorithms)
    [data]       dataset, data_dir, augment, crop_padding, flip, + dataset options
    [partition]  kind, + its parameters (dirichlet: alpha, min_size, ...), feature skew
                 (noise, noise_mode, brightness, saturation)
    [clients]    num, per_round, sampling (uniform | bernoulli | size), empty_rounds
                 (redraw | skip), replace_prob, replace_every
    [model]      name, channels_last, + model options (e.g. hidden = 256)
    [algorithm]  name, + algorithm parameters (e.g. mu = 0.01)
    [train]      local_epochs, batch_size, lr, lr_schedule, lr_decay, lr_step, lr_min,
                 warmup_rounds, local_schedule, local_decay, local_warmup, momentum,
                 nesterov, optimizer (sgd | adam), adam_betas, adam_eps, weight_decay,
                 grad_clip, global_lr
    [eval]       every, batch_size, update_stats, and for self-supervised runs the probes
                 (probes, probe_every, linear_epochs, linear_head, finetune_epochs,
                 finetune_fractions, finetune_head, local_spectra)
    [system]     device, gpu_share, precision, deterministic, threads, state_memory_mb,
                 state_dir, checkpoint_every
    [privacy]    mechanism (off | central | local | sample), clip, noise_multiplier, target_epsilon, delta,
                 accountant (auto | pld | rdp); docs/privacy.md
    [robust]     aggregator (none | mean | median | trimmed_mean | krum | multikrum |
                 geomed | normbound | bulyan | centered_clip | fltrust), f, bound,
                 cc_iterations, root_per_class, geomed_iterations, geomed_nu;
                 docs/robustness.md
    [attack]     kind (none | sign_flip | scale | gaussian | alie | ipm | min_max | min_sum |
                 label_flip | backdoor), fraction, scale, std, direction, target, trigger,
                 poison_fraction
"""

from .coerce import INT_MAX, SEED_MAX, build, check_scalar, field_error
from .schema import (OPEN_SECTIONS, AlgorithmConfig, ClientsConfig, DataConfig, EvalConfig,
                     ExperimentConfig, ModelConfig, PartitionConfig, SystemConfig, TrainConfig,
                     flatten)
from .sources import (CONFIG_MAX_BYTES, apply_overrides, load_file, load_preset, parse_override,
                      presets, read_toml_file, resolve)
from .toml import to_toml, toml_value
from .validate import NAME_MAX, from_dict, import_plugins, resolve_and_validate
from .vocab import PRECISIONS, PROBES

__all__ = [
    "AlgorithmConfig", "CONFIG_MAX_BYTES", "ClientsConfig", "DataConfig", "EvalConfig",
    "ExperimentConfig", "INT_MAX", "ModelConfig", "NAME_MAX", "OPEN_SECTIONS", "PRECISIONS",
    "PROBES", "PartitionConfig", "SEED_MAX", "SystemConfig", "TrainConfig", "apply_overrides",
    "build", "check_scalar", "field_error", "flatten", "from_dict", "import_plugins", "load_file",
    "load_preset", "parse_override", "presets", "read_toml_file", "resolve",
    "resolve_and_validate", "to_toml", "toml_value",
]
