"""Per-step run records: the versioned schema, the writer the training loop uses, the reader.

A run directory holds::

    RUN/meta.json                 one JSON object (META_KEYS): job, grid, hosts, versions, times
    RUN/records/rank-00000.csv    one line per step of rank 0, appended and flushed every step
    RUN/records/rank-00001.csv    ... (one file per rank: rows survive a crash of any rank)
    RUN/steps.parquet             all ranks merged at finish

The schema lives in :mod:`.schema` and only there (``COLUMNS``, ``SCHEMA_VERSION``); the
analysis reads it back with :func:`read_steps`. No torch import: the recorder is plain Python so
the analysis side can use it anywhere. The loss and validation histories a checkpoint holds are
packed by :mod:`.history` (torch imported only when one is packed or read).
"""

from .facts import git_facts, machine_facts, package_versions, rank_machine_facts, slurm_facts
from .reader import merge_records, pd_concat, read_rank_file, read_steps
from .recorder import LocalComm, LocalGrid, RunRecorder, row_from_counters
from .schema import (
    COLUMN_NAMES,
    COLUMNS,
    META_KEYS,
    OPTIONAL_COLUMNS,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    STATUSES,
    Column,
    encode_row,
    now_iso,
    open_nofollow,
    read_meta,
    read_regular,
    schema_markdown,
    strict_json,
    write_json_atomic,
)

__all__ = ["SCHEMA_VERSION", "SCHEMA_NAME", "Column", "COLUMNS", "COLUMN_NAMES", "META_KEYS",
           "STATUSES", "OPTIONAL_COLUMNS", "now_iso", "package_versions", "slurm_facts",
           "rank_machine_facts", "machine_facts", "git_facts", "LocalComm", "LocalGrid",
           "encode_row", "row_from_counters", "write_json_atomic", "read_meta", "open_nofollow",
           "read_regular", "RunRecorder", "read_rank_file", "merge_records", "read_steps",
           "schema_markdown", "strict_json", "pd_concat"]
