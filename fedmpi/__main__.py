"""``python -m fedmpi`` and the ``fedmpi`` command."""

import atexit
import gc
import signal


def entry() -> None:
    # At exit the interpreter's last garbage collections walked every object the imports
    # had made (torch's and fedmpi's, a few hundred thousand) only to find them alive: 0.4 s
    # of CPU in a 2.4 s command, per rank (benchmarks/startup.py). Frozen, they are freed
    # by the module teardown as before; registered first, this runs after every other exit
    # handler (MPI's finalise, the results file's close).
    atexit.register(gc.freeze)
    # Ctrl-C ends every command but `run` (which checkpoints first: fedmpi.signals) the
    # way the shell expects: at once, by the signal (exit 130), nothing printed. Python's
    # KeyboardInterrupt printed a traceback while the imports loaded, click's "Aborted!"
    # with exit 1 after them, and was lost where it landed in a finalizer: the command
    # went on.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from .cli import main

    main()


if __name__ == "__main__":
    entry()
