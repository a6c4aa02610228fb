"""Layout of a fedmpi results file, schema version 1 (prose: docs/results-schema.md).

One HDF5 file per run, written by rank 0 only, in the HDF5 1.10 format (``LIBVER``) and
kept in SWMR mode so it can be read while the run goes and after a crash::

    /                        attrs: format="fedmpi-results", schema_version, fedmpi_version,
                             created (ISO 8601 UTC), status, config (JSON, sorted keys),
                             config_hash (sha256 of config, 16 hex), json_attrs (JSON list
                             of the attrs stored as JSON), one attr per provenance key
                             (git_commit, hostnames, world_size, seed, torch_version, ...)
    /partition/              client_offsets (C+1,), client_indices (N,), class_counts
                             (C, K), client_sizes (C,), public_indices, population
                             (stages, slots), identity_slot, identity_stage: int64;
                             noise_std, brightness, saturation (C,): float64; arrays of
                             >= 1024 elements are gzip-compressed
    /rounds/<field>          one extendable 1-D column per round field, one row per round
    /clients/<field>         one extendable 1-D column per field, one row per
                             (round, client) participation
    /client_eval/<field>     (eval.clients) one row per (evaluation round, evaluated
                             client): its local test split's size, accuracy and loss
    /model/layout/           names (utf-8 str), shapes (utf-8 str, JSON list per tensor),
                             offsets (int64), sizes (int64): one row per tensor
    /model/<name>            float32 flat parameter vector, e.g. /model/final

Columns are float64 with NaN meaning "not measured", except the names in INT_FIELDS,
which are int64 with INT_FILL (-1) meaning "not recorded". The column order is the JSON
list in the group attr ``fields``. Every group carries ``schema_version``; columns with
a unit carry a ``units`` attr (see ``units_of``).
"""

SCHEMA_VERSION = 1
FORMAT = "fedmpi-results"

# File-format bounds: SWMR needs at least the HDF5 1.10 format; a plain "latest" would
# mean the newest format of the HDF5 h5py happens to bundle (2.0 here), which laptops
# with an older HDF5 could not read.
LIBVER = ("v110", "latest")

STATUSES = ("running", "completed", "failed", "interrupted", "pruned")

# Root attributes the writer owns; provenance and status extras may not shadow them.
RESERVED_ATTRS = frozenset(
    {"format", "schema_version", "fedmpi_version", "created", "status", "config",
     "config_hash", "json_attrs"}
)

# Counts and identifiers: stored exactly as int64 instead of float64.
INT_FIELDS = frozenset({"round", "client", "rank", "n_samples", "steps", "bytes_down", "bytes_up",
                        "bytes_sent", "bytes_received", "n_test", "held_out", "malicious"})
INT_FILL = -1

# What the runtime writes (the writer accepts any field list; these are the documented ones).
ROUND_FIELDS = (
    "round", "time_wall", "time_compute", "time_comm", "time_aggregate", "time_eval", "lr",
    "train_loss", "test_loss", "test_acc", "fl_bytes_down", "fl_bytes_up", "mpi_bytes",
    "n_participants", "update_norm",
)
CLIENT_FIELDS = (
    "round", "client", "rank", "n_samples", "steps", "train_loss", "update_norm",
    "bytes_down", "bytes_up", "seconds",
)
# Tables a run may add beside /clients, created with the file when its config asks for
# them: /client_eval (eval.clients), one row per (evaluation round, evaluated client).
TABLES = ("client_eval",)
CLIENT_EVAL_FIELDS = ("round", "client", "n_test", "accuracy", "loss")
PERSONAL_EVAL_FIELDS = ("personal_accuracy", "personal_loss")
PARTITION_KEYS = ("client_offsets", "client_indices", "class_counts", "client_sizes")

# Rows per chunk: each column with data holds at least one whole chunk on disk (4 KB at
# 512 rows), so chunks stay small; client rows come ~10-1000 per round.
ROUND_CHUNK = 128
CLIENT_CHUNK = 512
# Partition arrays at least this long are gzip-compressed (smaller ones gain nothing).
COMPRESS_MIN_SIZE = 1024


def column_dtype(field: str) -> str:
    """int64 for counts/ids so they stay exact and comparable; float64 so NaN can mark gaps."""
    return "int64" if field in INT_FIELDS else "float64"


def fill_value(field: str):
    """What a row holds for a field nobody wrote."""
    return INT_FILL if field in INT_FIELDS else float("nan")


def units_of(field: str) -> str | None:
    """Unit by naming convention, so new fields (knn_acc, time_probe) get one for free."""
    if field.startswith(("time_", "seconds")) or field in ("virtual_time", "vt_start", "vt_end"):
        return "s"
    if field == "n_available":
        return "clients"
    if "bytes" in field:
        return "bytes"
    if field.endswith("_acc"):
        return "fraction"
    return None


def kernels_by_kind(ranks: list[dict]) -> dict[str, list[int]]:
    """A rank table's (the ``ranks`` provenance attr, or a resume's) ranks by the kind of
    kernels each ran (``kernels``: "cpu AVX512 on AMD EPYC 9654", a GPU's model), in rank
    order; ranks recorded without it (files from before it) are left out."""
    kinds: dict[str, list[int]] = {}
    for r in ranks:
        if "kernels" in r:
            kinds.setdefault(r["kernels"], []).append(r["rank"])
    return kinds


def kernels_changed(before: list[dict], after: list[dict]) -> bool:
    """Whether two rank tables (a start's and a resume's) ran other kinds of kernels. A
    CPU's kind is its instruction set and its model ("cpu AVX512 on AMD EPYC 9654"); where
    either table is from before the model was recorded ("cpu AVX512"), only the
    instruction sets are compared. False where either recorded none."""
    was, now = set(kernels_by_kind(before)), set(kernels_by_kind(after))
    if not was or not now:
        return False
    if any(no_cpu_model(k) for k in was | now):
        was, now = ({instruction_set(k) for k in kinds} for kinds in (was, now))
    return was != now


def no_cpu_model(kind: str) -> bool:
    """A CPU's kernels recorded before the CPU's model was ("cpu AVX512")."""
    return kind.startswith("cpu ") and " on " not in kind


def instruction_set(kind: str) -> str:
    """A kind of kernels without the CPU's model: "cpu AVX512" (a GPU's model as it is)."""
    return kind.split(" on ")[0]


def ranks_text(ranks: list[int]) -> str:
    """"rank 2", "ranks 0, 1": the ranks of one kind, as the warning and the report name them."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
