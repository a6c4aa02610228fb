"""``python -m fedmpi`` and the ``fedmpi`` command."""

import atexit
import gc
import signal


def entry() -> None:
    # At exit the interpreter's last garbage collections walked every object still
    # tracked, nearly all of them made by the imports of torch and fedmpi and alive to the
    # end: 0.3-0.5 s of CPU in a 2-2.5 s command, in every rank (benchmarks/startup.py).
    # Frozen, the collector skips them and the process's end reclaims them. Nothing of
    # fedmpi's is left to a collection at exit: the results file, its lock and MPI are
    # closed explicitly or by exit handlers, and this one, registered first, runs last.
    atexit.register(gc.freeze)
    # Ctrl-C ends every command but `run` (which checkpoints first: fedmpi.signals) the
    # way the shell expects: at once, by the signal (exit 130), nothing printed. Python's
    # KeyboardInterrupt printed a traceback while the imports loaded, click's "Aborted!"
    # with exit 1 after them, and was lost where it landed in a finalizer: the command
    # went on.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from .cli import main   # deferred: after the handler, as Ctrl-C may come while it loads

    main()


if __name__ == "__main__":
    entry()
