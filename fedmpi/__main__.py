"""``python -m fedmpi`` and the ``fedmpi`` command."""

import signal


def entry() -> None:
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
