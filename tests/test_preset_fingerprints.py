"""A refactor must not change a bit: every preset and algorithm, 2 small deterministic
rounds, against the fingerprints stored before for this kind of machine
(tools/preset_fingerprints.py: a set per kernel canary)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import preset_fingerprints  # noqa: E402


SHARDS = 4   # the suite's workers share the cases (a single test of 38 was its longest)


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
def test_every_preset_and_algorithm_gives_the_stored_bits(shard):
    only = sorted(preset_fingerprints.cases())[shard::SHARDS]
    canary, found = preset_fingerprints.all_fingerprints(processes=1, only=only)
    stored = json.loads(preset_fingerprints.STORED.read_text())
    verdict, message = preset_fingerprints.compare(stored, canary, found, only=only)
    if verdict == "no set":
        pytest.skip(message)
    assert verdict == "same", message


def _family(cpu, **cases):
    return {"cpu": cpu, "fingerprints": {case: {"model": m, "rounds": "r", "clients": "c"}
                                         for case, m in cases.items()}}


def test_the_set_for_this_machines_canary_is_the_one_compared():
    stored = {"aaaa": _family("A", x="1", y="2"), preset_fingerprints.UNRECORDED: _family("old", x="9", y="9")}
    found = _family("", x="1", y="2")["fingerprints"]
    assert preset_fingerprints.compare(stored, "aaaa", found)[0] == "same"
    verdict, message = preset_fingerprints.compare(stored, "aaaa", {**found, "y": {**found["y"], "model": "3"}})
    assert verdict == "changed" and "'y': ['model']" in message and "canary aaaa (A;" in message
    # another machine's kernels: the set without a canary, when there is one
    assert preset_fingerprints.compare(stored, "bbbb", found)[0] == "changed"
    assert preset_fingerprints.compare(stored, "bbbb", _family("", x="9", y="9")["fingerprints"])[0] == "same"
    del stored[preset_fingerprints.UNRECORDED]
    verdict, message = preset_fingerprints.compare(stored, "bbbb", found)
    assert verdict == "no set" and "canary bbbb" in message and "--add" in message
    verdict, message = preset_fingerprints.compare(stored, "aaaa", {"x": found["x"]})
    assert verdict == "changed" and "['y']" in message


@pytest.mark.slow
def test_each_librarys_pin_moves_the_canary():
    """The canary differs when any one of the four libraries' pins does: it sees every
    library that picks kernels by the CPU. (That it repeats, in fresh processes with one
    core or two, the comparison with the stored set shows.)"""
    import os
    import subprocess

    code = "import sys; sys.path.insert(0, 'tools'); import preset_fingerprints as p; print(p.kernel_canary())"

    def canary(**change):
        env = {**os.environ, **preset_fingerprints.PINNED, **change}
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                              text=True, check=True, timeout=300).stdout.strip()

    pinned = canary()
    assert len(pinned) == 16
    for change in ({"MKL_CBWR": "COMPATIBLE"}, {"ATEN_CPU_CAPABILITY": "default"},
                   {"ONEDNN_MAX_CPU_ISA": "SSE41"}, {"OPENBLAS_CORETYPE": "Sandybridge"}):
        assert canary(**change) != pinned, change


def test_a_shard_compares_its_cases_and_still_sees_cases_added_or_removed():
    names = sorted(preset_fingerprints.cases())
    fp = {c: {"model": "1", "rounds": "r", "clients": "c"} for c in names}
    stored = {"aaaa": {"cpu": "A", "fingerprints": fp}}
    one = names[:1]
    assert preset_fingerprints.compare(stored, "aaaa", {one[0]: fp[one[0]]}, only=one)[0] == "same"
    changed = {one[0]: {**fp[one[0]], "model": "2"}}
    assert preset_fingerprints.compare(stored, "aaaa", changed, only=one)[0] == "changed"
    fewer = {"aaaa": {"cpu": "A", "fingerprints": {c: fp[c] for c in names[1:]}}}
    verdict, message = preset_fingerprints.compare(fewer, "aaaa", {names[1]: fp[names[1]]},
                                                   only=names[1:2])
    assert verdict == "changed" and "cases added or removed" in message and names[0] in message
