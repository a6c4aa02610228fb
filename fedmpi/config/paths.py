"""Where a config file's relative paths point: the files a run reads (its data, device
profiles, availability traces) are found beside the config file that names them, as
most tools read paths inside a file; what a run writes (``output``, ``system.state_dir``)
goes where the run is started. Paths from ``--set`` and the presets point from the
current directory, as a shell's do.

A relative input path of a config file becomes absolute when the file is read, so every
later message names the absolute path tried, and the results file records where the
data was."""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError

# (section, key): the inputs a config file may name relatively
INPUT_PATHS = (("data", "data_dir"), ("data", "path"), ("data", "cache_dir"),
               ("system_model", "profile_file"), ("system_model", "availability_file"))


def anchor_inputs(values: dict, config_file: str | Path) -> dict:
    """``values`` (a config file's, as read) with its relative input paths made absolute
    against the file's folder. A path found only relative to the current directory (the
    rule before) is refused in one line that says both places, so a config written for
    the old rule never reads other data silently."""
    base = Path(config_file).expanduser().absolute().parent
    for section, key in INPUT_PATHS:
        table = values.get(section)
        if not isinstance(table, dict) or not isinstance(table.get(key), str):
            continue
        text = table[key]
        if not text or text.startswith("~") or Path(text).is_absolute():
            continue   # unset (""), the home folder, or absolute: as written
        anchored = base / text
        if not anchored.exists() and Path(text).exists() and base != Path.cwd().absolute():
            raise UsageError(
                f"config field {section}.{key}: {text!r} is read relative to the config "
                f"file's folder, as {anchored}, which does not exist ({Path(text).absolute()} "
                f"does: write the path relative to {config_file} or as an absolute path)")
        table[key] = str(anchored)
    return values
