"""Figure files, for `fedmpi plot -o` and `fedmpi partition --plot`.

Figures are built on ``matplotlib.figure.Figure`` with the Agg canvas, never pyplot, so
they need no display and leave a notebook's backend alone; matplotlib stays optional.
The file name is checked before any work (a data set may take a while to load): its
suffix must be a format matplotlib writes, so a slip such as ``--plot run.h5`` or
``-o exp.toml`` is one line that lists the formats, and the file named keeps its bytes.
A path that cannot be written (a missing folder, a full disk, a pipe) is one line too.
"""

from __future__ import annotations

from pathlib import Path

from fedmpi.errors import UsageError


def check_path(path, what: str, command: str) -> Path:
    """``path`` as a Path, once its suffix names a format matplotlib writes. ``what`` names
    the file in messages ("plot file"); ``command`` is what needs matplotlib ("fedmpi plot")."""
    FigureCanvasAgg = _agg(command)[1]
    path = Path(path)
    formats = FigureCanvasAgg.get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in formats:
        raise UsageError(f"{what} {path}: the name must end in a format matplotlib writes, "
                         f"e.g. .png, .pdf, .svg (allowed: {', '.join(sorted(formats))})")
    if not path.parent.is_dir():
        raise UsageError(f"{what} {path} cannot be written ({path.parent} is not a folder)")
    return path


def new_figure(command: str, **options):
    """A Figure on the Agg canvas (``options``: figsize, dpi)."""
    Figure, FigureCanvasAgg = _agg(command)
    figure = Figure(**options)
    FigureCanvasAgg(figure)
    return figure


def save(figure, path, what: str, command: str, **options) -> Path:
    """Write ``figure`` to ``path`` (checked as ``check_path`` does); an unwritable path
    (a missing folder, a full disk, a pipe) is a UsageError that names it."""
    path = check_path(path, what, command)
    try:
        figure.savefig(path, **options)
    except OSError as exc:   # io.UnsupportedOperation (a pipe, not seekable) is one too
        raise UsageError(f"{what} {path} cannot be written ({exc.strerror or exc})") from exc
    return path


def _agg(command: str):
    try:   # deferred: matplotlib is optional (a plot's alone) and takes ~1 s to load
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(f"{command} needs matplotlib: pip install matplotlib") from None
    return Figure, FigureCanvasAgg
