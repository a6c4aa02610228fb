"""A real single-node SLURM cluster on localhost, for the job-template tests.

``LocalSlurm`` writes a minimal slurm.conf into a temporary directory and starts the
three daemons from Debian's ``slurm-wlm`` and ``munge`` packages in the foreground, as
children of the test process (they die with it): munged (authentication, on its own
socket and key), slurmctld (the controller) and slurmd (this machine as node
``hostname -s``). The cluster lives in the temporary directory alone, so a site's own
SLURM or munge keeps running undisturbed: other ports, another socket, another key,
``SLURM_CONF`` pointing the client commands (sbatch, squeue, scontrol, scancel) at our
controller.

Choices that make one small machine a usable cluster:

- the node claims at least 8 CPUs (``SlurmdParameters=config_overrides`` stops slurmd
  from draining it for having fewer): a job of 1 server + 2 workers needs 3 task slots,
  and the ranks share the real cores as they do under ``mpirun --oversubscribe``;
- ``proctrack/linuxproc`` and ``task/none``: no cgroups, which containers often lack;
- ``cred_expire=10``: a requeued job waits this long before it may start again
  (default 120 s), which is what the preemption test waits through;
- ``MinJobAge=600``: finished jobs stay visible to ``scontrol show job`` (there is no
  accounting database, so no sacct);
- ``FirstJobId``/``MaxJobId``: each cluster on the machine numbers its jobs from a block
  of its own, held by a lock for the cluster's life. Every pytest-xdist worker starts a
  cluster, and two clusters both running job 2 collide: the PMIx plugin names its
  directories by job and step id alone, so the second ``srun --mpi=pmix`` step fails to
  launch ("task 0 launch failed: Unspecified error", caught by CI), and a test that finds
  a job's ranks by SLURM_JOB_ID would find the other cluster's too.

``ensure_installed`` installs the packages with apt-get when we are root and they are
missing (once per machine: the outcome of a failed attempt is cached), with
``libpmix-dev`` so that ``srun --mpi=pmix``, the templates' default launch, works. Anything that
keeps the cluster from running raises ``SlurmUnavailable`` with the reason, including
the daemon log's last lines; the fixture turns that into a skip.
"""

from __future__ import annotations

import ctypes
import fcntl
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun")
# libpmix-dev: Debian's Slurm PMIx plugin dlopens the unversioned libpmix.so it ships;
# without it ``srun --mpi=pmix`` cannot start MPI ranks (the templates' default launch).
PACKAGES = ("slurm-wlm", "munge", "libpmix-dev")
_LIBPMIX = "/usr/lib/*/pmix2/lib/libpmix.so"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"}
_SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
_PR_SET_PDEATHSIG = 1
_INSTALL_FAILED = Path(tempfile.gettempdir()) / "fedmpi-slurm-install-failed.txt"
# Job ids in blocks of JOB_ID_BLOCK, BLOCKS of them under SLURM's default MaxJobId (67043328)
JOB_ID_BLOCK, BLOCKS = 65536, 1000
_JOB_ID_LOCKS = Path(tempfile.gettempdir()) / "fedmpi-slurm-job-ids"


class SlurmUnavailable(Exception):
    """This machine cannot run the local cluster; the message says why."""


def _which(name: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", "")] + list(_SBIN))
    return shutil.which(name, path=path)


def missing_programs() -> list[str]:
    missing = [name for name in DAEMONS + CLIENTS + ("mungekey",) if _which(name) is None]
    return missing + ([] if glob.glob(_LIBPMIX) else ["libpmix.so"])


def ensure_installed(timeout: float = 900) -> None:
    """Install slurm-wlm and munge with apt-get if they are missing and we may.

    A failed install is remembered (in the temp dir) so every later session skips at
    once instead of waiting on apt again; delete the file to retry.
    """
    missing = missing_programs()
    if not missing:
        return
    if _INSTALL_FAILED.exists():
        raise SlurmUnavailable(f"missing {', '.join(missing)}; an earlier apt-get install failed "
                               f"({_INSTALL_FAILED.read_text().strip()[-300:]})")
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"missing {', '.join(missing)} and cannot install them "
                               f"(needs root and apt-get: apt-get install {' '.join(PACKAGES)})")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *PACKAGES]):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
            failed = proc.returncode != 0 and f"{' '.join(cmd)}: {proc.stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            failed = f"{' '.join(cmd)} took over {timeout:.0f} s"
        if failed:
            _INSTALL_FAILED.write_text(failed + "\n")
            raise SlurmUnavailable(failed)
    if missing_programs():
        raise SlurmUnavailable(f"apt-get installed {' '.join(PACKAGES)} but "
                               f"{', '.join(missing_programs())} are still missing")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _claim_job_ids():
    """(first job id, the open lock file that holds its block): the first block, from one
    that depends on our pid on, that no living process holds (flock ends with its holder)."""
    _JOB_ID_LOCKS.mkdir(exist_ok=True)
    for i in range(BLOCKS):
        block = (os.getpid() + i) % BLOCKS
        lock = open(_JOB_ID_LOCKS / f"{block}.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return block * JOB_ID_BLOCK + 1, lock
    raise SlurmUnavailable(f"all {BLOCKS} job-id blocks in {_JOB_ID_LOCKS} are held")


def _memory_mb() -> int:
    with open("/proc/meminfo") as f:
        total_kb = int(f.readline().split()[1])
    return max(total_kb // 1024 - 512, 256)


class LocalSlurm:
    """One node, daemons owned by this object, two partitions on it: ``debug`` (the
    default) and ``urgent``, whose jobs preempt debug's as a site's would: PreemptMode=REQUEUE
    with ``GRACE_TIME`` seconds of grace (TERM to the job's steps, then requeue)."""

    PARTITIONS = ("debug", "urgent")
    GRACE_TIME = 60

    def __init__(self, root: Path | None = None, cpus: int | None = None):
        self.root = Path(root or tempfile.mkdtemp(prefix="fedmpi-slurm-"))
        self.node = socket.gethostname().split(".")[0]
        self.cpus = cpus or max(os.cpu_count() or 1, 8)
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}
        self._job_ids = None   # the lock on our block of job ids, while the cluster lives

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, timeout: float = 60) -> "LocalSlurm":
        if os.geteuid() != 0:
            raise SlurmUnavailable("the local cluster runs slurmd as root (SlurmUser=root); not root")
        try:
            self._write_config()
            self._start_munge()
            self._spawn("slurmctld", ["-D", "-c", "-i", "-f", str(self.conf)])
            self._spawn("slurmd", ["-D", "-f", str(self.conf), "-N", self.node])
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel every job, wait for them to leave, end our daemons, remove the directory."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            for partition in self.PARTITIONS:
                self.client(["scancel", f"--partition={partition}"], check=False)
            deadline = time.time() + 30
            while time.time() < deadline and self.client(["squeue", "-h"], check=False).stdout.strip():
                time.sleep(0.5)
        for name in reversed(list(self.procs)):
            _terminate(self.procs[name])
        self.procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        if self._job_ids is not None:
            self._job_ids.close()
            self._job_ids = None

    def __enter__(self) -> "LocalSlurm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- configuration ------------------------------------------------------------------
    def _write_config(self) -> None:
        for sub in ("state", "spool", "munge", "log"):
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)
        # munged wants its socket's directories searchable by everyone
        self.root.chmod(0o711)
        (self.root / "munge").chmod(0o711)
        first_job_id, self._job_ids = _claim_job_ids()
        self.conf.write_text("\n".join([
            "ClusterName=fedmpitest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "JobRequeue=1",
            "ReturnToService=2",
            "MinJobAge=600",
            f"FirstJobId={first_job_id}",
            f"MaxJobId={first_job_id + JOB_ID_BLOCK - 1}",
            "KillWait=10",
            "InactiveLimit=0",
            "SchedulerParameters=sched_interval=2",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} "
            f"RealMemory={_memory_mb()} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP "
            f"PriorityTier=1 PreemptMode=REQUEUE GraceTime={self.GRACE_TIME}",
            f"PartitionName=urgent Nodes={self.node} MaxTime=INFINITE State=UP "
            f"PriorityTier=2 PreemptMode=OFF",
            "",
        ]))
        # Only read by cgroup plugins, which this config does not load; kept so a site
        # copying the config for task/cgroup has the file to fill in.
        (self.root / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")


    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"], check=True,
                       capture_output=True)
        key.chmod(0o400)
        d = self.root / "munge"
        self._spawn("munged", ["--foreground", "--force", f"--key-file={key}",
                               f"--socket={self.munge_socket}", f"--pid-file={d / 'munged.pid'}",
                               f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), 15, "munged did not create its socket")

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen([_which(name), *args], stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env(),
                                            start_new_session=True, preexec_fn=_die_with_parent)
        log.close()

    def _wait_idle(self, timeout: float) -> None:
        def idle():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with {proc.returncode}: {self.log_tail(name)}")
            out = self.client(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split()
            return set(out) == {"idle"}   # one line per partition
        self._wait(idle, timeout, "node never became idle")

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if ready():
                return
            time.sleep(0.3)
        raise SlurmUnavailable(f"{what} within {timeout:.0f} s: {self.log_tail()}")

    # ---- using it -----------------------------------------------------------------------
    def env(self, extra: dict | None = None) -> dict:
        """The environment for client commands and jobs: our SLURM_CONF, sbin on PATH."""
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        env.update(extra or {})
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), *_SBIN])
        return env

    def client(self, args: list[str], check: bool = True, env: dict | None = None,
               cwd=None, timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run(args, capture_output=True, text=True, env=env or self.env(),
                              cwd=cwd, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def sbatch(self, args: list[str], env: dict | None = None, cwd=None) -> str:
        """Submit; returns the job id."""
        out = self.client(["sbatch", "--parsable", *args], env=env, cwd=cwd).stdout.strip()
        return out.split(";")[0]

    def jobs(self, job_id: str) -> list[dict]:
        """``scontrol show job`` as one dict per job (an array gives one per task)."""
        out = self.client(["scontrol", "show", "job", "-o", job_id], check=False).stdout
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]

    def wait(self, job_id: str, timeout: float = 120) -> list[dict]:
        """Wait until the job (every task of an array) has ended; returns ``jobs``."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            jobs = self.jobs(job_id)
            if jobs and all(j.get("JobState") in TERMINAL for j in jobs) and \
                    not any("-" in j.get("ArrayTaskId", "") for j in jobs):
                return jobs
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still running after {timeout:.0f} s: {self.jobs(job_id)}")

    def pmix_works(self) -> str | None:
        """None when ``srun --mpi=pmix`` starts MPI ranks here, else why not."""
        proc = self.client(["srun", "--mpi=pmix", "-n", "1", "true"], check=False)
        return None if proc.returncode == 0 else " ".join(proc.stderr.split())[-300:]

    def log_tail(self, name: str | None = None, lines: int = 8) -> str:
        names = [name] if name else list(self.procs) or list(DAEMONS)
        parts = []
        for n in names:
            for path in (self.root / "log" / f"{n}.log", self.root / "log" / f"{n}.out",
                         self.root / "munge" / f"{n}.log"):
                if path.exists() and path.stat().st_size:
                    tail = path.read_text(errors="replace").strip().splitlines()[-lines:]
                    parts.append(f"[{path.name}] " + " | ".join(tail))
                    break
        return " ".join(parts) or "(no daemon logs)"


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies (no orphan daemons)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _terminate(proc: subprocess.Popen, grace: float = 10) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
