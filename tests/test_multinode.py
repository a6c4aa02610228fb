"""fedmpi across several nodes, played on one machine by fake nodes (tests/fake_nodes.py):
one PRRTE daemon per node, each in a host name of its own, so MPI sees distinct nodes
(shared memory inside one, TCP between, a node communicator each).

At 2 nodes (3 + 2 ranks) and 3 nodes (1 + 2 + 2: the server alone on the first) one
launch each checks, in one MPI job: a deterministic run is bitwise the single process's;
each node's leader alone loaded the data and its other ranks read that copy; each worker
takes its node's workers' thread share and, with CUDA faked (2 GPUs a node), its GPU by
its place among its node's workers; a node whose data differs stops the run in one line
before any work. The multi-node SLURM template, run as SLURM would run it with its
mpirun reaching the nodes through the same agent, places the server and one worker per
node and gives the same bits.
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, fedmpi
from fake_nodes import FakeNodes, launch, unavailable
from fedmpi.config import to_toml
from fedmpi.results import open_run
from fedmpi.runtime.system import choose_threads
from helpers import TINY, merged

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable() is not None,
                                                   reason=str(unavailable()))]

PLUGIN = "fedmpi_fake_node_data"
# synthetic's data, each load logged as "host rank"; on the host named by stale_on one
# label differs (that node's copy is stale)
PLUGIN_SOURCE = '''
import os, socket
from fedmpi.data import load_dataset, register

@register("logged_synthetic")
def load(data_dir=None, seed=0, num_train=600, num_test=200, size=16, log="", stale_on=""):
    ds = load_dataset("synthetic", data_dir, seed, num_train=num_train, num_test=num_test,
                      size=size)
    host = socket.gethostname()
    if log:
        with open(log, "a") as f:
            f.write(f"{host} {os.environ.get('OMPI_COMM_WORLD_RANK', '0')}\\n")
    if host == stale_on:
        ds.train_y[0] = (ds.train_y[0] + 1) % ds.num_classes
    return ds
'''

# Run on the fake nodes: RUN_CONFIG THREADS_CONFIG STALE_CONFIG. Rank 0 prints one JSON
# line, every rank's report. The ranks are fresh interpreters: one forked from this test
# process's zygote (conftest.mpirun) would keep this machine's host name.
RANKS = r'''
import json, os, socket, sys
import numpy as np
import torch
from fedmpi import algorithms, config as cfg
from fedmpi.comm import make_comm
from fedmpi.errors import UsageError
from fedmpi.runtime import run_experiment
from fedmpi.runtime.system import choose_device, node_workers
from fedmpi.runtime.world import build_world

comm = make_comm()
report = {"rank": comm.rank, "host": socket.gethostname()}
run_experiment(cfg.resolve(sys.argv[1], None, []), comm, quiet=True)

config = cfg.resolve(sys.argv[2], None, [])   # not deterministic: threads by node
world = build_world(config, comm, algorithms.build(config.algorithm.name, config.algorithm.params))
spans = [(np.frombuffer(b, dtype=np.uint8).ctypes.data, len(b))
         for b in (w.Shared_query(0)[0] for _, w in comm.node_windows)]
report["threads"] = world.threads
report["in_window"] = any(s <= world.dataset.train_x.data_ptr() < s + n for s, n in spans)

stale = cfg.resolve(sys.argv[3], None, [])   # a run would abort on it: build its world
try:
    build_world(stale, comm, algorithms.build(stale.algorithm.name, stale.algorithm.params))
except UsageError as exc:
    report["stale"] = str(exc)

torch.cuda.is_available = lambda: True          # 2 GPUs a node, every worker sees both
torch.cuda.device_count = lambda: 2
os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
peers = node_workers(comm)
report["node_workers"] = [rank for rank, _ in peers]
report["device"] = str(choose_device("auto", comm.is_worker, comm.rank, peers))
everyone = comm.gather_obj(report, count=False)
if comm.is_server:
    print(json.dumps(everyone))
'''

BITWISE = merged(TINY, rounds=2, system={"deterministic": True}, plugins=[PLUGIN],
                 data={"dataset": "logged_synthetic", "num_train": 600, "num_test": 200,
                       "size": 16})


def write(path: Path, values: dict) -> Path:
    path.write_text(to_toml(values))
    return path


def plugin_env(folder: Path) -> dict:
    (folder / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), str(ROOT),
                                                        os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-process run of BITWISE (no launcher): the reference."""
    tmp = tmp_path_factory.mktemp("single")
    config = write(tmp / "single.toml", BITWISE)
    fedmpi(["run", "-q", config, "-o", tmp / "single.h5"], check=True, env=plugin_env(tmp))
    return tmp / "single.h5"


def same_bits(reference: Path, other: Path, size: int) -> None:
    with open_run(reference) as a, open_run(other) as b:
        assert b.status == "completed" and b.attrs["world_size"] == size
        for key in ("test_acc", "test_loss", "train_loss", "fl_bytes_up"):
            assert np.array_equal(a.rounds()[key], b.rounds()[key], equal_nan=True), key
        assert np.array_equal(a.model(), b.model())


def loads(log: Path) -> list[tuple[str, int]]:
    """(host, rank) of each load of the data, in order."""
    return sorted((host, int(rank)) for host, rank in map(str.split, log.read_text().splitlines()))


@pytest.mark.parametrize("ranks", [[3, 2], [1, 2, 2]], ids=["2 nodes", "3 nodes"])
def test_a_run_over_nodes_is_the_single_process_run_with_the_data_once_per_node(
        single, tmp_path, ranks):
    """Until now every node-aware piece had run on one node only (the tests that play
    another node with ``unshare --uts`` rename one rank under one launcher: MPI still saw
    one node, and the data was not shared there)."""
    nodes = FakeNodes(tmp_path / "nodes", ranks)
    hosts = nodes.host_of_rank()
    log = tmp_path / "loads.txt"
    run = write(tmp_path / "run.toml", merged(BITWISE, data={"log": str(log)},
                                              output=str(tmp_path / "run.h5")))
    threads = write(tmp_path / "threads.toml", merged(BITWISE, system={"deterministic": False}))
    stale = write(tmp_path / "stale.toml", merged(BITWISE, data={"stale_on": nodes.names[-1]}))
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    proc = launch(nodes.mpirun([sys.executable, script, run, threads, stale]),
                  env={**plugin_env(tmp_path), **nodes.env()})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["host"] for r in report] == hosts

    same_bits(single, tmp_path / "run.h5", nodes.size)
    with open_run(tmp_path / "run.h5") as result:
        assert [r["host"] for r in result.attrs["ranks"]] == hosts
    # each node's lowest rank loaded; the node's other ranks read its window
    leaders = [(host, hosts.index(host)) for host in nodes.names]
    assert loads(log) == leaders
    assert [r["in_window"] for r in report] == [hosts.count(h) > 1 for h in hosts]

    workers = {h: [r for r in range(1, nodes.size) if hosts[r] == h] for h in nodes.names}
    assert [r["node_workers"] for r in report] == [workers[h] for h in hosts]
    share = {h: choose_threads(0, False, True, local_workers=len(w)) for h, w in workers.items()}
    assert [r["threads"] for r in report] == [1] + [share[h] for h in hosts[1:]]
    # the k-th worker of a node takes cuda:k on every node (one node of 4 would need 4 GPUs)
    assert [r["device"] for r in report] == ["cpu"] + [
        f"cuda:{workers[h].index(r)}" for r, h in enumerate(hosts) if r]

    said = {r.get("stale") for r in report}
    assert len(said) == 1 and "\n" not in (line := said.pop()), report
    last = nodes.names[-1]
    assert line.startswith(f"rank {hosts.index(last)} on {last} loaded other data than rank 0 on "
                           f"{nodes.names[0]} (data.dataset = logged_synthetic; SHA-256 "), line
    assert line.endswith("is a node's copy stale or incomplete? Nothing was run")


SCONTROL = """#!/bin/sh
# scontrol show hostnames LIST, for a LIST of names separated by commas
[ "$1 $2" = "show hostnames" ] || exit 1
printf '%s\\n' "$3" | tr , '\\n'
"""


def test_the_multi_node_template_places_the_server_and_a_worker_on_each_node(single, tmp_path):
    """jobs/slurm/multi_node.sbatch run as SLURM runs a batch script (a stand-in for
    scontrol), on 3 nodes with one worker each (--ntasks-per-node=2: G = 1) under
    FEDMPI_LAUNCHER=mpirun. Its hostfile lists each node once per rank: with --map-by slot
    mpirun took a node listed once for all its cores, and put 2 workers on the second node
    and none on the third."""
    nodes = FakeNodes(tmp_path / "nodes", [2, 1, 1])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    log = tmp_path / "loads.txt"
    write(tmp_path / "run.toml", merged(BITWISE, data={"log": str(log)}, output="run.h5"))
    env = {**plugin_env(tmp_path), **nodes.env(),
           "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent),
                                    os.environ["PATH"]]),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": ",".join(nodes.names),
           "SLURM_NTASKS_PER_NODE": "2", "FEDMPI_LAUNCHER": "mpirun", "TMPDIR": str(tmp_path)}
    proc = launch(["bash", ROOT / "jobs/slurm/multi_node.sbatch", "run.toml"], env=env,
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"on {','.join(nodes.names)}: mpirun, 4 ranks, cell 0 of run.toml" in proc.stdout
    same_bits(single, tmp_path / "run.h5", 4)
    with open_run(tmp_path / "run.h5") as result:
        assert [r["host"] for r in result.attrs["ranks"]] == nodes.host_of_rank()
    assert loads(log) == [(nodes.names[0], 0), (nodes.names[1], 2), (nodes.names[2], 3)]
    assert not list(tmp_path.glob("fedmpi-hosts-*"))   # the template removed its hostfile


HANGS_ONCE = """#!/bin/sh
# the first try starts a process that leaves for a session of its own (as PRRTE's daemon
# does) and no rank, and hangs; the next one is done at once
if [ ! -e tried ]; then
  touch tried
  setsid sh -c 'echo $$ > detached.pid; exec sleep 300' &
  exec sleep 300
fi
echo done
"""


def test_a_launch_that_starts_no_rank_is_killed_whole_and_tried_again(tmp_path):
    """About one launch in twenty hung before starting any rank. Killing the launch's
    process group missed the daemons (each in a session of its own), which kept its
    output open: the test waited on it for good."""
    script = tmp_path / "launcher.sh"
    script.write_text(HANGS_ONCE)
    proc = launch(["sh", script], cwd=tmp_path, start_timeout=1, attempts=2)
    assert proc.returncode == 0 and proc.stdout == "done\n"
    detached = int((tmp_path / "detached.pid").read_text())
    deadline = time.monotonic() + 10
    while alive(detached):
        assert time.monotonic() < deadline, "the detached process outlived the killed try"
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
