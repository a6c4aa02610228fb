"""Several nodes on one machine, for a real mpirun: MPI sees distinct nodes.

Open MPI 5's launcher (PRRTE) starts one daemon per host of the hostfile through its ssh
agent (``--prtemca plm_ssh_agent AGENT``, or ``PRTE_MCA_plm_ssh_agent`` in the
environment; ``plm_rsh_agent`` is silently ignored in this version). The agent here runs
the daemon's command on this machine, in a UTS namespace of its own whose host name is
the node's (``unshare --uts``; ``--user`` as well when not root). Each daemon, and every
rank it starts, then is on its own node as far as MPI is concerned: one node
communicator per node (``COMM_TYPE_SHARED``), shared memory inside it, TCP between
nodes, local ranks counted per node; ``socket.gethostname()`` in a rank is its node's
name. The names are never resolved (no /etc/hosts entry: the agent is the only way in).

``launch`` runs a command (mpirun itself, or a job script that calls it) under a
timeout: a launch that has started no rank within ``start_timeout`` (PRRTE's start-up
hangs now and then) is killed, its whole process tree, and tried again; one past
``timeout`` is killed and fails with what it printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

from conftest import LAUNCH_RACE, mpirun_path

# Candidates, the first that works here wins: root needs only the UTS namespace; others
# need a user namespace too, keeping their own uid where util-linux can (a daemon that
# finds itself root refuses to start; with --map-root-user it is told it may).
_UNSHARE = (["unshare", "--uts"],
            ["unshare", "--user", "--map-current-user", "--keep-caps", "--uts"],
            ["unshare", "--user", "--map-root-user", "--uts"])

_AGENT = r"""#!/bin/sh
# PRRTE's ssh agent for fake nodes: AGENT [options] HOST COMMAND...; runs COMMAND here
# (as a remote shell would, words joined by spaces) with HOST as this namespace's name.
while [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
command="$*"
%(as_root)s
exec %(unshare)s sh -c 'hostname "$1" && exec sh -c "$2"' fake-node "$host" "$command"
"""
# with --map-root-user the daemon runs as root inside: let it
_AS_ROOT = 'command=$(printf "%s" "$command" | sed "s|/prted |/prted --allow-run-as-root |")'


@lru_cache(maxsize=1)
def unshare_prefix() -> tuple[str, ...] | None:
    """The ``unshare`` command that gives a process a host name of its own here, or None
    where none may (no util-linux, or namespaces not permitted)."""
    for prefix in _UNSHARE:
        if prefix[1:2] == ["--uts"] and os.geteuid() != 0:
            continue
        try:
            proc = subprocess.run([*prefix, "sh", "-c", "hostname fake-node-probe && hostname"],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if proc.returncode == 0 and proc.stdout.strip() == "fake-node-probe":
            return tuple(prefix)
    return None


def unavailable() -> str | None:
    """Why fake nodes cannot run here, or None."""
    if mpirun_path() is None:
        return "no mpirun (pip install '.[mpi]')"
    if not (Path(mpirun_path()).parent / "prted").exists():
        return f"{mpirun_path()} is not Open MPI 5's (no PRRTE daemon, prted, beside it)"
    if unshare_prefix() is None:
        return ("unshare --uts is not permitted here (neither as root nor in a user namespace: "
                "unshare --user --map-root-user --uts): no host name of its own per fake node")
    return None


class FakeNodes:
    """``ranks[i]`` ranks on node i, named ``fakenode-a``, ``fakenode-b``, ...: a hostfile and
    an agent written into ``folder``; ``mpirun(args)`` is the command line that places them
    (rank order fills the first node, then the next), ``env()`` what a job script's own
    mpirun needs to reach the nodes through the agent."""

    def __init__(self, folder: Path, ranks: list[int]):
        prefix = unshare_prefix()
        if prefix is None:
            raise RuntimeError(unavailable())
        folder.mkdir(parents=True, exist_ok=True)
        self.names = [f"fakenode-{chr(ord('a') + i)}" for i in range(len(ranks))]
        self.ranks = list(ranks)
        self.hostfile = folder / "hostfile"
        self.hostfile.write_text("".join(f"{name} slots={n}\n"
                                         for name, n in zip(self.names, ranks)))
        self.agent = folder / "fake-node-agent.sh"
        as_root = _AS_ROOT if "--map-root-user" in prefix else ""
        self.agent.write_text(_AGENT % {"unshare": " ".join(prefix), "as_root": as_root})
        self.agent.chmod(0o755)

    @property
    def size(self) -> int:
        return sum(self.ranks)

    def host_of_rank(self) -> list[str]:
        return [name for name, n in zip(self.names, self.ranks) for _ in range(n)]

    def mpirun(self, args: list[str]) -> list[str]:
        return [mpirun_path(), "-n", str(self.size), "--hostfile", str(self.hostfile),
                "--prtemca", "plm_ssh_agent", str(self.agent),
                "--oversubscribe", "--bind-to", "none", *map(str, args)]

    def env(self) -> dict[str, str]:
        return {"PRTE_MCA_plm_ssh_agent": str(self.agent),
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def launch(cmd: list[str], env: dict | None = None, cwd=None, timeout: float = 180,
           start_timeout: float = 30, attempts: int = 3) -> subprocess.CompletedProcess:
    """Run ``cmd`` (``FakeNodes.mpirun(...)``, or a script that starts mpirun) with ``env``
    added to this process's environment. A try that starts no rank (no process under a
    PRRTE daemon) within ``start_timeout`` seconds, or that fails with Open MPI's
    start-up race (conftest.LAUNCH_RACE), is killed and started again, at most
    ``attempts`` times in all; nothing of the command has run then. Past ``timeout``
    the try is killed and an AssertionError says what it printed."""
    run_env = dict(os.environ, **(env or {}))
    for attempt in range(attempts):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=run_env, cwd=cwd, start_new_session=True)
        started = killed = False
        begun = time.monotonic()
        while True:
            try:
                out, err = proc.communicate(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            waited = time.monotonic() - begun
            started = started or _a_rank_runs(proc.pid)
            if waited > timeout or (not started and waited > start_timeout):
                kill_tree(proc.pid)
                killed = True
                try:
                    out, err = proc.communicate(timeout=10)
                except subprocess.TimeoutExpired:   # something outside the tree holds them
                    raise AssertionError(f"{' '.join(map(str, cmd))}: its output stayed open "
                                         f"after its process tree was killed") from None
                break
        if killed and started:
            raise AssertionError(f"{' '.join(map(str, cmd))} ran past {timeout:.0f} s "
                                 f"(killed)\n{out}\n{err}")
        if not killed and LAUNCH_RACE not in out + err:
            return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        why = (f"started no rank within {start_timeout:.0f} s" if killed
               else "hit Open MPI's start-up race")
        print(f"fake nodes: try {attempt + 1} {why}; trying again\n{err[-2000:]}", file=sys.stderr)
    raise AssertionError(f"{' '.join(map(str, cmd))}: no try of {attempts} got past "
                         f"start-up\n{out}\n{err}")


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command name), from /proc."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        table[int(entry.name)] = (int(stat[stat.rindex(")") + 2:].split()[1]), name)
    return table


def _tree(root: int, table: dict) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _a_rank_runs(root: int) -> bool:
    """Whether a process under one of ``root``'s PRRTE daemons runs something else: a rank
    (a forked daemon has the daemon's name until it execs)."""
    table = _processes()
    return any(table[pid][1] != "prted" and table.get(table[pid][0], (0, ""))[1] == "prted"
               for pid in _tree(root, table) if pid in table)


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and everything under it. A daemon detaches into a session of its
    own (killing the launch's process group misses it), so the tree is frozen first
    (SIGSTOP until no new process appears), then killed, children and all."""
    seen: set[int] = set()
    while True:
        pids = [pid for pid in _tree(root, _processes()) if pid not in seen]
        if not pids:
            break
        for pid in pids:
            _signal(pid, signal.SIGSTOP)
        seen.update(pids)
    for pid in seen:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
