"""A refactor must not change a bit: every preset and algorithm, 2 small deterministic
rounds, against the fingerprints stored before (tools/preset_fingerprints.py)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import preset_fingerprints  # noqa: E402

STORED = ROOT / "tests" / "data" / "preset_fingerprints.json"


@pytest.mark.slow
def test_every_preset_and_algorithm_gives_the_stored_bits():
    stored = json.loads(STORED.read_text())
    found = preset_fingerprints.all_fingerprints()
    assert sorted(found) == sorted(stored), "cases added or removed: regenerate on purpose"
    changed = {case: [part for part in stored[case] if found[case][part] != stored[case][part]]
               for case in stored if found[case] != stored[case]}
    assert not changed, f"results changed: {changed}"
