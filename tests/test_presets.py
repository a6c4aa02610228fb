"""Every shipped preset is a valid experiment (papers' headline settings and small ones)."""

import pytest

from fedmpi import config as cfg


@pytest.mark.parametrize("name", cfg.presets())
def test_preset_resolves(name):
    c = cfg.resolve(preset=name)
    assert c.rounds > 0 and c.algorithm.name
