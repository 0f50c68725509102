"""The reader: rank CSV files (torn or damaged lines skipped with a note) and the merged
parquet back into one typed pandas frame with the schema's columns."""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from hpcpar.errors import RunDirError
from hpcpar.formats.records.schema import (
    ACCEPTED_NAMES,
    COLUMN_NAMES,
    HEADER_TAG,
    KINDS,
    OPTIONAL_COLUMNS,
    SCHEMA_VERSION,
    open_nofollow,
    oserror_text,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    import pandas as pd


# -- the reader ------------------------------------------------------------------------------
_REQUIRED = ("step", "rank")  # never empty in a row the recorder wrote


def _short(path: Path) -> str:
    """``records/rank-00001.csv`` style name for notes."""
    return f"{path.parent.name}/{path.name}"


def _typed(df):
    """Schema dtypes: int columns int64 (float64 when a cell is empty), float columns float64."""
    import pandas as pd

    out = {}
    for name in COLUMN_NAMES:
        if name not in df:  # an optional column the file predates
            out[name] = pd.Series(math.nan, index=df.index, dtype="float64")
            continue
        col = pd.to_numeric(df[name], errors="coerce").astype("float64")
        if KINDS[name] == "int" and not col.isna().any():
            col = col.astype("int64")
        out[name] = col
    return pd.DataFrame(out, index=df.index)


def _parse_line(line: bytes, rank: int | None, names: Sequence[str] = COLUMN_NAMES):
    """Values of one CSV row of the schema, or None when the line is not one (wrong number of
    fields, text in a number, empty step/rank, another rank's row in a rank file)."""
    try:
        cells = line.decode("ascii").split(",")
    except UnicodeDecodeError:
        return None
    if len(cells) != len(names):
        return None
    values = []
    for name, cell in zip(names, cells):
        cell = cell.strip()
        if not cell:
            if name in _REQUIRED:
                return None
            values.append(math.nan)
            continue
        try:
            v = int(cell) if KINDS[name] == "int" else float(cell)
        except ValueError:
            return None
        if name in _REQUIRED and v < 0:
            return None
        values.append(v)
    if rank is not None and values[1] != rank:
        return None
    return values


def _fast_rows(header: bytes, rows: bytes, rank: int | None, lines: int,
               names: Sequence[str] = COLUMN_NAMES):
    """pandas' C parser on a healthy segment; None when anything looks off (then the careful
    line-by-line parser decides)."""
    import pandas as pd

    try:
        df = pd.read_csv(io.BytesIO(header + b"\n" + rows))
    except Exception:  # noqa: BLE001 - any parser complaint: read line by line instead
        return None
    if len(df) != lines or rows.count(b",") != lines * (len(names) - 1):
        return None
    if tuple(df.columns) != tuple(names) or any(df[c].dtype.kind not in "iuf" for c in df):
        return None
    if df[list(_REQUIRED)].isna().any().any() or (df[list(_REQUIRED)] < 0).any().any():
        return None
    if rank is not None and len(df) and not (df["rank"] == rank).all():
        return None
    return _typed(df)


def _parse_rows(header: bytes, rows: bytes, rank: int | None, bad: list,
                names: Sequence[str] = COLUMN_NAMES):
    """Rows of one segment of a rank file; lines that are not rows go to ``bad``."""
    import pandas as pd

    rows = b"\n".join(line for line in rows.split(b"\n") if line.strip()) + b"\n"
    lines = rows.count(b"\n") if rows.strip() else 0
    if not lines:
        return _typed(pd.DataFrame({c: [] for c in COLUMN_NAMES}))
    df = _fast_rows(header, rows, rank, lines, names)
    if df is not None:
        return df
    good = []
    for line in rows.split(b"\n")[:-1]:
        values = _parse_line(line, rank, names)
        if values is None:
            bad.append(line)
        else:
            good.append(values)
    return _typed(pd.DataFrame(good or None, columns=list(names)))


def read_rank_file(path: str | os.PathLike, notes: list | None = None) -> pd.DataFrame:
    """One rank's step file (``rank-NNNNN.csv``) as its step table; RunDirError when it is not a
    step record of this schema version.

    A torn last line (crash mid-write) is dropped; where the step goes back (a resumed run
    appending from its checkpoint), every earlier row at or past that step is replaced (steps
    redone after the checkpoint, and stale ones the crash left behind). Lines that are not
    rows of the schema (damage, another rank's row) are left out, with one note in ``notes``
    saying how many. Files of older hpcpar versions (a schema tag line first, ``# resume``
    lines) read the same.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RunDirError(f"{path}: unreadable ({oserror_text(exc)})") from None
    if data.startswith(HEADER_TAG.encode()):  # written before 0.2: a schema tag line first
        tag, _, data = data.partition(b"\n")
        version = tag[len(HEADER_TAG):].decode(errors="replace").strip()
        if version != str(SCHEMA_VERSION):
            raise RunDirError(f"{path}: schema version {version}, this hpcpar reads version "
                              f"{SCHEMA_VERSION}")
    if not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
    header, _, body = data.partition(b"\n")
    names = tuple(header.decode(errors="replace").split(","))
    if names not in ACCEPTED_NAMES:
        raise RunDirError(f"{path}: not an hpcpar step record (first line "
                          f"{header[:60].decode(errors='replace')!r})")
    name = path.name
    rank = int(name[5:-4]) if name.startswith("rank-") and name[5:-4].isdigit() else None
    rows = b"\n".join(line for line in body.split(b"\n") if not line.startswith(b"#"))
    bad: list = []
    df = _parse_rows(header, rows, rank, bad, names)
    if bad and notes is not None:
        notes.append(f"{_short(path)}: {len(bad)} unreadable line(s) left out (first: "
                     f"{bad[0][:40].decode(errors='replace')!r})")
    return _latest_segments(df)


def _latest_segments(df: pd.DataFrame) -> pd.DataFrame:
    """Rows in file order -> one row per step, the latest run's. A resumed run appends from
    its checkpoint's step, so wherever the step goes back (or repeats) a new segment starts,
    and it replaces every earlier row at or past its first step: steps redone after the
    checkpoint, and stale ones the crash left behind."""
    import numpy as np

    steps = df["step"].to_numpy()
    starts = [0, *(np.flatnonzero(steps[1:] <= steps[:-1]) + 1), len(df)]
    out = df.iloc[starts[0]:starts[1]]
    for a, b in zip(starts[1:-1], starts[2:]):
        seg = df.iloc[a:b]
        out = pd_concat([out[out["step"] < seg["step"].min()], seg])
    return out.drop_duplicates(["rank", "step"], keep="last").reset_index(drop=True)


def pd_concat(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Concatenate step tables into one with a fresh index, keeping the schema's column types."""
    import pandas as pd

    return _typed(pd.concat(frames, ignore_index=True))


def _sorted(df):
    return df.sort_values(["step", "rank"], kind="stable").reset_index(drop=True)


def _read_rank_files(files, notes: list | None):
    """All rank files merged; with ``notes``, a file that cannot be read is skipped and noted
    (its rank then counts as missing), else it raises."""
    frames = []
    for f in files:
        try:
            frames.append(read_rank_file(f, notes))
        except RunDirError as exc:
            if notes is None:
                raise
            notes.append(f"{_short(f)} skipped: {str(exc).removeprefix(f'{f}: ')}")
    if not frames:
        raise RunDirError(f"{files[0].parent}: no readable rank-*.csv step records")
    return _sorted(pd_concat(frames))


def merge_records(run_dir: str | os.PathLike) -> Path:
    """Merge a run's per-rank step files into ``RUN/steps.parquet`` (returned); RunDirError when
    there are none. Damaged lines and unreadable rank files are left out (the rank files stay
    as they are)."""
    run_dir = Path(run_dir)
    files = sorted((run_dir / "records").glob("rank-*.csv"))
    if not files:
        raise RunDirError(f"{run_dir / 'records'}: no rank-*.csv step records")
    df = _read_rank_files(files, [])
    import pyarrow as pa  # a required dependency: records are always parquet
    import pyarrow.parquet as pq

    out = run_dir / "steps.parquet"
    tmp = out.with_name(".steps.parquet.tmp")
    table = pa.Table.from_pandas(df, preserve_index=False)
    meta = dict(table.schema.metadata or {})
    meta[b"hpcpar.schema_version"] = str(SCHEMA_VERSION).encode()
    # a file object, never a path: pyarrow would expand a "~" in it (another directory than
    # the run's) and follow a link placed at the temporary name
    with open(tmp, "wb", opener=open_nofollow) as f:
        pq.write_table(table.replace_schema_metadata(meta), f)
    os.replace(tmp, out)
    return out


def _read_parquet(path: Path):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises its own types for broken files
        why = (str(exc).splitlines() or [type(exc).__name__])[0]
        why = why.replace(f" '{path}'", "").replace(str(path), path.name).split(". ")[0]
        raise RunDirError(f"{path}: unreadable ({why[:160]})") from None
    version = (table.schema.metadata or {}).get(b"hpcpar.schema_version", b"?").decode()
    if version != str(SCHEMA_VERSION):
        raise RunDirError(f"{path}: schema version {version}, this hpcpar reads "
                          f"version {SCHEMA_VERSION}")
    return table.to_pandas()


def read_steps(run_dir: str | os.PathLike, notes: list | None = None) -> pd.DataFrame:
    """The step table of a run (one row per rank per step), checked against the schema version.

    Reads steps.parquet / steps.csv when the run finished, else the per-rank files (a crashed or
    running run). Without a ``notes`` list any damage raises RunDirError; with one, the reader
    keeps what it can and appends one line per problem: a merged file that cannot be read falls
    back to the rank files, an unreadable rank file is skipped, damaged lines are left out. No
    step records at all raise RunDirError either way.
    """
    run_dir = Path(run_dir)
    parquet, csv = run_dir / "steps.parquet", run_dir / "steps.csv"
    rank_files = sorted((run_dir / "records").glob("rank-*.csv"))
    newest_rank = max((f.stat().st_mtime for f in rank_files), default=0.0)
    df = None
    for merged, reader in ((parquet, _read_parquet), (csv, lambda f: read_rank_file(f, notes))):
        if df is None and merged.exists() and merged.stat().st_mtime >= newest_rank:
            try:
                df = reader(merged)
            except RunDirError as exc:
                if notes is None or not rank_files:
                    raise
                notes.append(f"{merged.name} {str(exc).removeprefix(f'{merged}: ')}: read "
                             f"records/rank-*.csv instead")
    if df is None and rank_files:
        df = _read_rank_files(rank_files, notes)
    if df is None:
        raise RunDirError(f"{run_dir}: no step records (steps.parquet, steps.csv or "
                          f"records/rank-*.csv)")
    for c in OPTIONAL_COLUMNS:  # a merged file written before the column existed
        if c not in df.columns:
            df[c] = math.nan
    missing = [c for c in COLUMN_NAMES if c not in df.columns]
    if missing:
        raise RunDirError(f"{run_dir}: step records lack column(s) {missing}")
    return df[list(COLUMN_NAMES)]
