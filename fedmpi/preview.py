"""`fedmpi partition CONFIG`: the federated split of a config, without training.

The split comes from the same `federate` the runtime calls, so what is previewed is
what a run with this config and seed will use, client for client.
"""

from __future__ import annotations

import numpy as np

from . import figures
from .data import load_dataset
from .data.heterogeneity import format_summary, plot_heatmap, summary
from .runtime.federation import federate


def preview(config, plot: str | None = None) -> str:
    """Statistics of the split as text lines; with ``plot``, the client x class heatmap."""
    if plot:   # a name matplotlib cannot write is refused before the data set loads
        figures.check_path(plot, "heatmap file", "--plot")
    dataset = load_dataset(config.data.dataset, config.data.data_dir, seed=config.seed,
                           **config.data.options)
    split = federate(config, dataset)
    counts = split.class_counts(dataset.train_y.numpy(), dataset.num_classes)
    n = config.clients.num
    lines = [f"dataset      {dataset.name} ({len(dataset.train_y)} train samples, "
             f"{dataset.num_classes} classes) from {dataset.source}",
             f"partition    {_describe(config.partition.kind, config.partition.params)}, "
             f"seed {config.seed}"]
    lines += _skew_lines(config, split)
    lines += ["", format_summary(summary(counts[:n]))]
    if plot:
        title = f"{dataset.name}: {_describe(config.partition.kind, config.partition.params)}"
        plot_heatmap(counts[:n], plot, title=title)
        lines.append(f"heatmap      {plot}")
    return "\n".join(lines)


def _describe(kind: str, params: dict) -> str:
    return kind + "".join(f" {k}={v}" for k, v in params.items() if v is not None)


def _skew_lines(config, split) -> list[str]:
    p, cl, lines = config.partition, config.clients, []
    if len(split.public):
        lines.append(f"public set   {len(split.public)} samples from {config.data.public_from}"
                     + (" (LEAKY: part of the test set)" if config.data.public_from == "test" else ""))
    if p.noise:
        std = split.noise_std[:cl.num]
        lines.append(f"noise        {p.noise_mode}: std {std.min():.3g}..{std.max():.3g}"
                     + (f" in a {split.noise_blocks}x{split.noise_blocks} grid cell" if split.noise_blocks else ""))
    for name, values, width in (("brightness", split.brightness, p.brightness),
                                ("saturation", split.saturation, p.saturation)):
        if width:
            lines.append(f"{name:<12} factors {values.min():.3f}..{values.max():.3f} (one per client)")
    if cl.replace_every:
        joined = np.bincount(split.identity_stage, minlength=len(split.population))[1:]
        lines.append(f"population   {cl.num} slots, {len(split.population)} stages of "
                     f"{cl.replace_every} rounds, {split.num_identities - cl.num} newcomers "
                     f"(per stage: {' '.join(map(str, joined.tolist()))}); statistics below "
                     f"are for stage 0")
    return lines
