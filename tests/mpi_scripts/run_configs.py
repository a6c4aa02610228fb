"""Run under mpirun: several experiments one after another in one MPI job, one launch
instead of one per config (each launch starts every rank's Python and torch again).

    mpirun -n 3 python run_configs.py CONFIG OUTPUT [CONFIG OUTPUT ...]
"""

import sys

from fedmpi import config as cfg
from fedmpi.comm import make_comm
from fedmpi.runtime import run_experiment

comm = make_comm()
args = sys.argv[1:]
for path, output in zip(args[::2], args[1::2]):
    run_experiment(cfg.resolve(path, None, [f"output={cfg.toml_value(output)}"]), comm, quiet=True)
