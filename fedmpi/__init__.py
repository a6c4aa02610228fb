"""fedmpi: a federated-learning research simulator for HPC clusters.

One MPI job simulates one FL experiment: rank 0 is the server, every other rank hosts
a group of simulated clients; parameters travel as flat buffers through MPI
collectives and everything a run produces goes into one HDF5 file.
"""

__version__ = "0.1.0"

from .api import Preempted, RunDiverged, run   # noqa: E402  (light: no torch until called)

__all__ = ["Preempted", "RunDiverged", "__version__", "run"]
