"""The client state store: zeros for unseen clients, LRU spill to disk past the memory
budget, exact round trips, and the checkpoint view of every client's state."""

import os
import socket
import subprocess

import numpy as np
import pytest

from fedmpi import config
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.runtime import run_experiment
from fedmpi.runtime.state import ClientStateStore, pack, pieces, unpack

from helpers import TINY, merged

SIZES = {"c_i": 5, "flag": 1}
STATE_BYTES = 6 * 4


def state(seed):
    rng = np.random.default_rng(seed)
    return {"c_i": rng.standard_normal(5).astype(np.float32),
            "flag": np.array([seed], dtype=np.float32)}


def assert_same(a, b):
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name])


def spilled(store):
    return sorted(int(p.stem) for p in store._spill_dir.glob("*.bin")) if store._spill_dir else []


def test_unseen_clients_get_zeros_and_are_not_stored():
    store = ClientStateStore(SIZES)
    got = store.get(7)
    assert_same(got, {"c_i": np.zeros(5, np.float32), "flag": np.zeros(1, np.float32)})
    assert len(store) == 0 and store.nbytes == 0


def test_without_a_budget_nothing_touches_disk(tmp_path):
    store = ClientStateStore(SIZES, directory=tmp_path / "spill")
    for c in range(20):
        store.put(c, state(c))
    assert len(store) == 20 and store.nbytes == 20 * STATE_BYTES and store.disk_bytes == 0
    assert not (tmp_path / "spill").exists()


def test_put_stores_a_copy_and_checks_sizes():
    store = ClientStateStore(SIZES)
    s = state(1)
    store.put(1, s)
    s["c_i"][:] = 99.0  # the caller's buffer changing later must not change the store
    assert_same(store.get(1), state(1))
    with pytest.raises(ValueError, match="c_i: 4 values, declared 5"):
        store.put(2, {"c_i": np.zeros(4), "flag": np.zeros(1)})


@pytest.mark.parametrize("budget_states", [0, 1, 3])
def test_budget_is_respected_and_spill_round_trips_exactly(tmp_path, budget_states):
    budget = budget_states * STATE_BYTES
    store = ClientStateStore(SIZES, memory_bytes=budget, directory=tmp_path)
    for c in range(8):
        store.put(c, state(c))
        assert store.nbytes <= budget
    assert len(store) == 8
    assert store.nbytes + store.disk_bytes == 8 * STATE_BYTES
    assert len(spilled(store)) == 8 - budget_states
    for c in [5, 0, 7, 2, 2, 6, 1, 3, 4]:
        assert_same(store.get(c), state(c))
        assert store.nbytes <= budget
        assert len(store) == 8 and store.nbytes + store.disk_bytes == 8 * STATE_BYTES


def test_least_recently_used_states_are_spilled_first(tmp_path):
    store = ClientStateStore(SIZES, memory_bytes=3 * STATE_BYTES, directory=tmp_path)
    for c in range(3):
        store.put(c, state(c))
    assert spilled(store) == []
    store.get(0)                 # 0 is now the most recently used: order 1, 2, 0
    store.put(3, state(3))       # evicts 1
    assert spilled(store) == [1]
    store.put(2, state(20))      # an update is a use: order 0, 3, 2
    store.put(4, state(4))       # evicts 0
    assert spilled(store) == [0, 1]
    assert list(store._memory) == [3, 2, 4]
    assert_same(store.get(1), state(1))  # read back (file removed), evicts 3
    assert spilled(store) == [0, 3]
    assert list(store._memory) == [2, 4, 1]
    assert_same(store.get(2), state(20))


def test_spill_directory_is_private_and_removed_on_close(tmp_path):
    store = ClientStateStore(SIZES, memory_bytes=0, directory=tmp_path / "states")
    store.put(0, state(0))
    spill_dir = store._spill_dir
    assert spill_dir.parent == tmp_path / "states"
    assert (spill_dir / "0.bin").stat().st_size == STATE_BYTES
    store.close()
    assert not spill_dir.exists() and (tmp_path / "states").exists() and len(store) == 0


def test_spill_directories_of_dead_processes_on_this_host_are_removed(tmp_path):
    """A run killed outright leaves its spill directory; the next store to spill there
    removes the ones whose process on this host is gone, and no other."""
    host = socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()   # exited and reaped: its pid names no process
    parent = tmp_path / "states"
    kept = [parent / f"fedmpi-state-{host}.{os.getppid()}-abc",   # alive
            parent / f"fedmpi-state-elsewhere.{dead.pid}-abc",     # another host's
            parent / "fedmpi-state-x1y2z3"]                        # not ours to judge
    gone = parent / f"fedmpi-state-{host}.{dead.pid}-k1"
    for d in kept + [gone]:
        d.mkdir(parents=True)
        (d / "0.bin").write_bytes(b"\0" * STATE_BYTES)
    with ClientStateStore(SIZES, memory_bytes=0, directory=parent) as store:
        store.put(0, state(0))
        assert store._spill_dir.name.startswith(f"fedmpi-state-{host}.{os.getpid()}-")
        assert not gone.exists() and all((d / "0.bin").exists() for d in kept)
    assert sorted(parent.iterdir()) == sorted(kept)


def test_a_spill_directory_that_cannot_be_written_fails_at_the_start(tmp_path):
    """Not at the first spill, hours into the run: before the results file exists."""
    (tmp_path / "afile").write_text("")
    for bad in ("/proc/nope", tmp_path / "afile" / "states"):
        with pytest.raises(UsageError, match=f"config field system.state_dir: cannot write in {bad} "):
            ClientStateStore(SIZES, memory_bytes=0, directory=bad)
    ClientStateStore(SIZES, memory_bytes=None, directory="/proc/nope")   # no budget: no spill
    ClientStateStore({}, memory_bytes=0, directory="/proc/nope")         # no state: no spill
    values = merged(TINY, rounds=1, algorithm={"name": "scaffold"}, output=str(tmp_path / "r.h5"),
                    system={"state_memory_mb": 0, "state_dir": "/proc/nope"})
    with pytest.raises(UsageError, match="system.state_dir"):
        run_experiment(config.from_dict(values), LocalComm(), quiet=True)
    assert not (tmp_path / "r.h5").exists() and not list(tmp_path.glob(".r.h5*"))


def test_default_spill_directory_is_a_temporary_one_removed_on_close():
    with ClientStateStore(SIZES, memory_bytes=STATE_BYTES) as store:
        store.put(0, state(0))
        store.put(1, state(1))
        spill_dir = store._spill_dir
        assert spill_dir.exists() and spilled(store) == [0]
    assert not spill_dir.exists()


def test_items_and_state_dict_see_every_client_without_touching_the_budget(tmp_path):
    store = ClientStateStore(SIZES, memory_bytes=2 * STATE_BYTES, directory=tmp_path)
    for c in [4, 1, 3, 0, 2]:
        store.put(c, state(c))
    order = list(store._memory)
    pairs = list(store.items())
    assert [c for c, _ in pairs] == [0, 1, 2, 3, 4] == store.clients()
    for c, s in pairs:
        assert_same(s, state(c))
    assert list(store._memory) == order and store.nbytes <= 2 * STATE_BYTES
    assert set(store.state_dict()) == {0, 1, 2, 3, 4}


def test_load_state_dict_restores_a_checkpoint_exactly(tmp_path):
    source = ClientStateStore(SIZES, memory_bytes=STATE_BYTES, directory=tmp_path / "a")
    for c in range(4):
        source.put(c, state(c))
    target = ClientStateStore(SIZES, memory_bytes=2 * STATE_BYTES, directory=tmp_path / "b")
    target.put(9, state(9))      # replaced, not merged
    target.load_state_dict(source.items())
    assert target.clients() == [0, 1, 2, 3] and target.nbytes <= 2 * STATE_BYTES
    for c in range(4):
        assert_same(target.get(c), state(c))
    assert_same(target.get(9), {"c_i": np.zeros(5, np.float32), "flag": np.zeros(1, np.float32)})
    again = ClientStateStore(SIZES)
    again.load_state_dict(source.state_dict())
    assert all(np.array_equal(again.get(c)["c_i"], state(c)["c_i"]) for c in range(4))


def test_a_run_whose_states_all_spill_is_bitwise_the_in_memory_run(tmp_path):
    """system.state_memory_mb = 0 sends every client state to disk (system.state_dir)."""
    from fedmpi.results import RunFile
    from helpers import TINY, merged
    from test_runtime import run_tiny

    base = merged(TINY, rounds=3, clients={"num": 6, "per_round": 4},
                  algorithm={"name": "scaffold"}, system={"deterministic": True})
    c, _, run = run_tiny(tmp_path, "memory", base=base)
    run.close()
    spilled = merged(base, system={"state_memory_mb": 0, "state_dir": str(tmp_path / "spill")})
    c2, exp, run2 = run_tiny(tmp_path, "disk", base=spilled)
    run2.close()
    assert exp.store.nbytes == 0 and len(exp.store) == 6
    assert len(list((tmp_path / "spill").glob("*/*.bin"))) == 6
    with RunFile(c.output_path()) as a, RunFile(c2.output_path()) as b:
        assert np.array_equal(a.model(), b.model())


def test_states_travel_as_one_flat_buffer_and_come_back_bit_for_bit():
    """What the runtime sends between ranks instead of pickles: pack/pieces out, unpack in."""
    states = {7: state(7), 2: state(2), 30: state(30)}
    ids, flat = pack(states, SIZES)
    assert ids.tolist() == [7, 2, 30] and flat.dtype == np.float32 and flat.size == 3 * 6
    back = unpack(flat, ids, SIZES)
    assert list(back) == [7, 2, 30]
    for c in states:
        assert_same(back[c], states[c])
        assert np.shares_memory(back[c]["c_i"], flat)     # views, not copies
    assert np.array_equal(np.concatenate(pieces(states.values(), SIZES)), flat)
    empty_ids, empty = pack({}, SIZES)
    assert empty_ids.size == empty.size == 0 and unpack(empty, [], SIZES) == {}
    with pytest.raises(ValueError, match="client 2 state c_i: 4 values, declared 5"):
        pack({2: {"c_i": np.zeros(4), "flag": np.zeros(1)}}, SIZES)
    with pytest.raises(ValueError, match="18 values received, 12 expected"):
        unpack(flat, [7, 2], SIZES)
