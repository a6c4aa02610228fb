"""The results file: one versioned HDF5 file per run, written by rank 0, read anywhere.

Schema in ``fedmpi.results.schema`` and docs/results-schema.md.
"""

from fedmpi.results.reader import RunFile, open_run
from fedmpi.results.schema import SCHEMA_VERSION
from fedmpi.results.writer import ResultsWriter

__all__ = ["SCHEMA_VERSION", "ResultsWriter", "RunFile", "open_run"]
