"""Preemption requests: SIGUSR1 (SLURM ``--signal``) and SIGTERM set a flag, nothing else.

Installed as the first thing ``fedmpi run`` does, before torch is imported, so a signal
that arrives while a rank is still starting up is remembered rather than killing it; the
runtime checks the flag at every round boundary and checkpoints (DESIGN.md section 10).
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_requested = threading.Event()


def _handler(signum, frame) -> None:
    _requested.set()


def install() -> dict | None:
    """Route the preemption signals to the flag; returns the previous handlers (None when
    not on the main thread, where Python cannot install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return {sig: signal.signal(sig, _handler) for sig in SIGNALS}


def restore(previous: dict | None) -> None:
    for sig, handler in (previous or {}).items():
        signal.signal(sig, handler)


def requested() -> bool:
    return _requested.is_set()


def clear() -> None:
    _requested.clear()
