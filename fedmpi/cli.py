"""The ``fedmpi`` command: thin click commands over the library.

Bad input of any kind is one line on stderr and exit code 2, before any MPI work and
without touching an existing results file.
"""

from __future__ import annotations

import os
import re
import sys

import click

from .errors import UsageError, did_you_mean, one_line_errors, say
from .signals import launcher_rank as _launcher_rank   # light: no torch

# deferred imports: each command imports what it runs, so that `fedmpi --help`, a bad
# option and the light commands answer without loading torch (~1.5 s); `run` pays for
# it once its arguments are known.

EXIT_FAILED, EXIT_INTERRUPTED = 1, 130   # 130: killed by SIGINT, by convention
# The commands whose ranks work together under mpirun or srun; every other command is
# one process's work, done by launcher rank 0 alone (the others exit 0 at once): three
# ranks printed a report three times, wrote one figure three times over each other, and
# `fedmpi evaluate` raced for the file's lock and ended the job with exit 2.
MPI_COMMANDS = ("run", "sweep", "tune")


class _CommandLineError(click.UsageError):
    """click's own command-line errors (an unknown option or command, a missing argument)
    said as fedmpi says all bad input: one line, from rank 0 only. click printed four
    lines of usage and hint, once per rank under mpirun."""

    def __init__(self, error: click.UsageError, root: str, path: str):
        super().__init__(error.format_message(), error.ctx)
        self.root, self.path = root, error.ctx.command_path if error.ctx is not None else path

    def show(self, file=None) -> None:
        spaced = _spaced_set_value(self.ctx, self.format_message())
        if spaced:
            say(spaced)
            return
        command = self.path[len(self.root):].strip()   # `run` of `python -m fedmpi run`
        message = self.format_message().rstrip(".")
        say(f"{command + ': ' if command else ''}{message[:1].lower()}{message[1:]} "
            f"(see {self.path} --help)")


def _spaced_set_value(ctx, message: str) -> str | None:
    """`fedmpi run exp.toml --set train.lr 0.1`: click's "unexpected extra argument (0.1)"
    said as what was meant (`--set train.lr=0.1`), or None."""
    extra = re.fullmatch(r"Got unexpected extra arguments? \((.*)\)\.?", message)
    overrides = ctx.params.get("overrides") if ctx is not None and extra else None
    if not overrides:
        return None
    from .config.sources import refuse_spaced_value

    positionals = [ctx.params.get(p.name) for p in ctx.command.params
                   if isinstance(p, click.Argument)] + extra.group(1).split()
    try:
        refuse_spaced_value(overrides, positionals)
    except UsageError as error:
        return str(error)
    return None


class _Commands(click.Group):
    """``fedmpi --help`` lists each command with its whole first sentence (click cuts it
    at the terminal's width with "..."); command-line errors are one line."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.exceptions.NoArgsIsHelpError:   # `fedmpi` alone: the help, as before
            raise
        except click.UsageError as error:
            root = info_name or "fedmpi"
            raise _CommandLineError(error, root, root) from None

    def resolve_command(self, ctx, args):
        name, command, rest = super().resolve_command(ctx, args)
        ctx.meta["fedmpi.command"] = name   # for errors click raises without a context
        return name, command, rest

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:   # Ctrl-C, where main() is not called by __main__.entry
            sys.exit(EXIT_INTERRUPTED)
        except click.UsageError as error:
            name = ctx.meta.get("fedmpi.command")
            root = ctx.find_root().command_path
            raise _CommandLineError(error, root, f"{ctx.command_path} {name}" if name else
                                    ctx.command_path) from None

    def format_commands(self, ctx, formatter):
        rows = [(name, command.get_short_help_str(limit=1000))
                for name, command in ((n, self.get_command(ctx, n)) for n in self.list_commands(ctx))
                if command is not None and not command.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fedmpi")
@one_line_errors
def main():
    """fedmpi: federated-learning experiments on MPI, results in one HDF5 file."""
    from .streams import hold_standard_descriptors

    hold_standard_descriptors()   # before any file is opened
    if click.get_current_context().invoked_subcommand not in MPI_COMMANDS and _launcher_rank():
        sys.exit(0)   # `srun fedmpi report|plot|evaluate`: launcher rank 0 does it, once
    try:   # a removed working directory: torch's MKL would die loading its libraries
        os.getcwd()
    except FileNotFoundError:
        raise UsageError("the current directory no longer exists (was it removed?); "
                         "cd to one that does and run again") from None


def _config_options(command):
    command = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                           help="Override a config field, e.g. --set train.lr=0.1 (repeatable).")(command)
    command = click.option("--preset", metavar="NAME",
                           help="A named preset (see `fedmpi presets`); default: 'default'.")(command)
    # plain strings: the config loader says in one line what is wrong with a path
    return click.argument("config_file", required=False)(command)


def _resolve(config_file, preset, overrides, output=None):
    from . import config as cfg

    cfg.sources.refuse_spaced_value(overrides, [config_file])   # `--set train.lr 0.1`
    overrides = list(overrides) + ([f"output={cfg.toml_value(output)}"] if output else [])
    config = cfg.resolve(config_file, preset, overrides)
    if _launcher_rank() == 0:   # stderr: `fedmpi config > exp.toml` stays clean TOML
        for note in config.algorithm_notes:
            click.echo(f"fedmpi: {note}", err=True)
    return config


@main.command()
@_config_options
@click.option("-o", "--output", metavar="PATH", help="Results file (same as --set output=PATH).")
@click.option("--force", is_flag=True, help="Overwrite an existing results file.")
@click.option("--resume", "resume_file", metavar="FILE",
              help="Continue the run in FILE from its last checkpoint (config from the file).")
@click.option("-q", "--quiet", is_flag=True, help="No per-round progress lines.")
@one_line_errors
def run(config_file, preset, overrides, output, force, resume_file, quiet):
    """Run an experiment: CONFIG_FILE (TOML) or --preset, single process or under mpirun.

    Exit codes: 0 done, 1 diverged, crashed or the storage full, 2 bad input, 75
    checkpointed on SIGUSR1/SIGTERM/SIGHUP or a Ctrl-C (preemption, scancel) or before the
    results file's disk filled up: run again with --resume FILE to continue; 130 stopped at
    once by a second Ctrl-C (resumes from the last checkpoint).
    """
    from . import signals, streams

    signals.install()  # before the heavy imports: a signal during start-up counts
    from .results.writer import FileReplacedError
    from .runtime import EXIT_PREEMPTED, run_experiment

    if resume_file:
        config = _resume_config(resume_file, config_file or preset or overrides or output or force)
        if config is None:
            return
    else:
        config = _resolve(config_file, preset, overrides, output)
        from .api import prepare
        prepare(config, force)
    path = config.output_path()
    streams.keep_going(f"the run goes on without progress lines; follow it with: "
                       f"fedmpi watch {path}")
    try:
        experiment = run_experiment(config, force=force, quiet=quiet, resume=bool(resume_file))
    except FileReplacedError as exc:   # someone else's file now: leave it alone
        click.echo(f"fedmpi: {exc}", err=True)
        sys.exit(EXIT_FAILED)
    except KeyboardInterrupt:   # a second Ctrl-C: the file says interrupted
        if _launcher_rank() == 0:
            click.echo(f"fedmpi: stopped by a second Ctrl-C; {path} resumes from its last "
                       f"checkpoint: fedmpi run --resume {path}", err=True)
        sys.exit(EXIT_INTERRUPTED)
    if experiment.preempted:
        sys.exit(EXIT_PREEMPTED)
    if experiment.comm.is_server:
        if experiment.diverged:
            click.echo(f"fedmpi: run diverged; results so far in {path}", err=True)
            sys.exit(EXIT_FAILED)
        if not quiet:
            from .analysis.run_summary import closing_lines
            click.echo("\n".join(closing_lines(path)))


def _resume_config(path, other_arguments):
    """The config of the run in ``path``, writing to ``path``; None if it already completed."""
    from .api import resume_config

    if other_arguments:
        raise UsageError("--resume FILE takes the config from FILE: drop the config file, "
                         "--preset, --set, -o and --force")
    config, _ = resume_config(path, speak=_launcher_rank() == 0)
    if config is None and _launcher_rank() == 0:
        click.echo(f"{path}: run already completed (or pruned by its tuning study); "
                   f"nothing to resume")
    return config


@main.command("config")
@_config_options
@one_line_errors
def show_config(config_file, preset, overrides):
    """Print the resolved config (file or preset + overrides) as TOML."""
    from .config import to_toml

    click.echo(to_toml(_resolve(config_file, preset, overrides).to_dict()), nl=False)


@main.command()
@one_line_errors
def presets():
    """List the named presets, each with the first line of its file (what it runs)."""
    from .config import presets as names
    from .config.sources import preset_description

    width = max(map(len, names()))
    for name in names():
        click.echo(f"{name:<{width}}  {preset_description(name)}".rstrip())


def _plugin_option(what: str):
    return click.option("--plugin", "plugins", multiple=True, metavar="MODULE",
                        help=f"Import MODULE first, as a config's plugins list does, to list the "
                             f"{what} it registers (repeatable).")


@main.command()
@click.argument("names", nargs=-1, metavar="[NAME]...")
@_plugin_option("algorithms")
@one_line_errors
def algorithms(names, plugins):
    """List the algorithms (all, or each NAME) with their parameters and defaults."""
    from .algorithms import REGISTRY, message_sizes, params_table
    from .config import import_plugins
    from .runtime.participation import Async

    import_plugins(list(plugins))
    for name in names:
        if name not in REGISTRY:
            raise UsageError(f"algorithm {name!r} does not exist{did_you_mean(name, REGISTRY)}; "
                             f"choose from {', '.join(sorted(REGISTRY))}")
    for name in dict.fromkeys(names) or sorted(REGISTRY):
        cls = REGISTRY[name]
        click.echo(f"{name}  ({cls.paper})")
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
        if doc:
            click.echo(f"    {doc[0]}")
        click.echo(f"    messages per client: {message_sizes(cls)}")
        declared = cls().compressible(1)
        click.echo(f"    compressible up: {', '.join(declared['up']) or 'none'}; down: "
                   f"{', '.join(declared['down']) or 'none'}; asynchronous (fedbuff, fedasync): "
                   f"{'yes' if Async.serves(name) else 'no'}")
        rows = params_table(cls)
        for field, default, help_text in rows:
            click.echo(f"    algorithm.{field} = {default!r}    {help_text}")
        if not rows:
            click.echo("    (no parameters)")


@main.command()
@click.option("--data-dir", metavar="DIR",
              help="Look here instead of the default places, as the config field data.data_dir does.")
@_plugin_option("datasets")
@one_line_errors
def datasets(data_dir, plugins):
    """List the datasets: found or not, where, and how to get a missing one."""
    from .config import import_plugins
    from .data import DATASETS, available_datasets

    import_plugins(list(plugins))
    data_dir = data_dir or None   # empty is unset, as in a config
    elsewhere = dict(available_datasets(None)) if data_dir else {}  # found without --data-dir
    found = available_datasets(data_dir)
    width = max(14, *(len(name) for name, _ in found))
    for name, where in found:
        hint = DATASETS[name].hint or f"see {DATASETS[name].load.__module__}"
        status, detail = ("found", where) if where else ("not found", hint)
        if not where and elsewhere.get(name):
            detail = f"not in {data_dir}; without --data-dir: {elsewhere[name]}"
        click.echo(f"{name:<{width}} {status:<9}  {detail}")


@main.command()
@_config_options
@click.option("--plot", metavar="PNG", type=click.Path(dir_okay=False),
              help="Also draw the client x class heatmap into this PNG file.")
@one_line_errors
def partition(config_file, preset, overrides, plot):
    """Preview a config's client split without training.

    Sizes, classes per client, label-skew scores, feature skew and population: the same
    split a run would use."""
    from .preview import preview

    click.echo(preview(_resolve(config_file, preset, overrides), plot=plot))


@main.command()
@_config_options
@click.option("--epsilon", "target", type=float, metavar="E",
              help="Print the noise multiplier that reaches epsilon E after the config's rounds.")
@one_line_errors
def privacy(config_file, preset, overrides, target):
    """User-level DP's budget for a config, without running it.

    The epsilon its rounds spend at privacy.noise_multiplier (dp-accounting, at
    privacy.delta), or with --epsilon the noise multiplier that reaches a target."""
    from . import privacy as accounting

    click.echo(accounting.summary(_resolve(config_file, preset, overrides), target))


@main.command()
@click.argument("file")
@click.option("--probe", "probe_names", multiple=True,
              type=click.Choice(["linear", "finetune", "spectrum"]),
              help="Probe to run (repeatable); default: the run's eval.probes, else linear "
                   "and spectrum.")
@click.option("--set", "overrides", multiple=True, metavar="eval.KEY=VALUE",
              help="Override an eval field, e.g. --set eval.linear_epochs=50 (repeatable).")
@click.option("-q", "--quiet", is_flag=True, help="No result line.")
@one_line_errors
def evaluate(file, probe_names, overrides, quiet):
    """Probe the encoder of a finished self-supervised run in FILE.

    Linear probe, fine-tuning or feature spectrum; the result is appended to its /eval group."""
    from .runtime.probes import evaluate_file

    evaluate_file(file, probe_names, overrides, quiet)


# Offline analysis (fedmpi.analysis): paper-style tables, figures, following a live run.
from .analysis.cli import plot, report, watch  # noqa: E402
from .sweep_cli import sweep  # noqa: E402
from .tune_cli import tune  # noqa: E402

for _command in (report, plot, watch, sweep, tune):
    main.add_command(_command)


if __name__ == "__main__":
    main()
