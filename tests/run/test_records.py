"""Run records: exact round trip, crash survival, resume replacement, schema checks, MPI merge."""

import json
from pathlib import Path

import pytest

from hpcpar.errors import RunDirError
from hpcpar.formats import records
from hpcpar.formats.records import COLUMN_NAMES, RunRecorder, read_meta, read_steps
from hpcpar.testing import mpi_case, shared_tmpdir


def row(step, rank=0, scale=1.0):
    return {"step": step, "loss": 1.0 / (step + 1), "t_data": 0.1 * scale, "t_fwd": 0.3 * scale,
            "t_bwd": 0.6 * scale, "t_halo": 0.05, "t_allreduce_exposed": 0.02,
            "t_allreduce_total": 0.2, "t_opt": 0.01, "t_step": 1.0 * scale + step * 1e-7,
            "samples": 8, "bytes_halo": 1 << 20, "bytes_allreduce": 3 << 20,
            "bytes_read": 123456789, "peak_mem": 2.5e9}


def test_round_trip_exact_and_meta(tmp_path):
    rec = RunRecorder(tmp_path / "run", None, {"job": {"name": "demo"}, "global_batch": 8,
                                               "job_file": __file__})
    for s in range(3):
        rec.step(**row(s))
    assert (tmp_path / "run/records/rank-00000.csv").exists()
    out = rec.finish("ok")
    assert out.name == "steps.parquet"
    df = read_steps(tmp_path / "run")
    assert tuple(df.columns) == COLUMN_NAMES and len(df) == 3
    for s in range(3):  # every value reads back bit for bit
        for k, v in row(s).items():
            assert df.loc[s, k] == v, (s, k)
    assert (df["rank"] == 0).all()
    meta = read_meta(tmp_path / "run")
    assert meta["job_name"] == "demo" and meta["status"] == "ok" and meta["end_time"]
    assert meta["ranks"] == 1 and meta["grid"] == {"data": 1, "x": 1, "y": 1, "z": 1}
    assert meta["segments"][0]["first_step"] == 0
    assert meta["versions"]["python"] and "torch" in meta["versions"]
    assert meta["versions"]["mpi_library"]
    assert meta["versions"]["malloc"] in ("system", "jemalloc", "tcmalloc", "mimalloc")
    assert meta["git"] and len(meta["git"]["commit"]) == 40  # this file is in a git repo
    assert meta["hostnames"] and meta["slurm"] is None


def test_crash_then_resume_replaces_redone_steps(tmp_path):
    run = tmp_path / "run"
    rec = RunRecorder(run, None, {"job_name": "demo"})
    for s in range(5):
        rec.step(**row(s))
    with open(rec.path, "a") as f:
        f.write("5,0,0.1,0.2")  # torn line: the process died mid-write
    rec.close()
    # crashed: no finish; the rows are on disk already, the run reads as running
    df = read_steps(run)
    assert list(df["step"]) == [0, 1, 2, 3, 4]
    assert read_meta(run)["status"] == "running"
    start = read_meta(run)["start_time"]
    rec2 = RunRecorder(run, None, {"job_name": "demo"}, resume=True)  # checkpoint was step 2
    for s in range(3, 7):
        rec2.step(**row(s, scale=2.0))
    rec2.finish("ok")
    df = read_steps(run)
    assert list(df["step"]) == list(range(7))
    assert list(df["t_step"][:3]) == [row(s)["t_step"] for s in range(3)]
    assert list(df["t_step"][3:]) == [row(s, scale=2.0)["t_step"] for s in range(3, 7)]
    meta = read_meta(run)
    assert meta["start_time"] == start and len(meta["segments"]) == 2
    assert meta["segments"][1]["first_step"] == 3
    # resumed again from step 1 and stopped at step 2: the stale steps 3..6 are gone too
    rec3 = RunRecorder(run, None, {"job_name": "demo"}, resume=True)
    for s in (1, 2):
        rec3.step(**row(s, scale=3.0))
    rec3.finish("preempted")
    df = read_steps(run)
    assert list(df["step"]) == [0, 1, 2] and df.loc[2, "t_step"] == row(2, scale=3.0)["t_step"]
    assert read_steps(run).equals(records.read_rank_file(run / "records/rank-00000.csv"))
    # the spool is plain CSV: pandas reads it without options, every row in file order
    import pandas as pd

    raw = pd.read_csv(run / "records/rank-00000.csv")
    assert tuple(raw.columns) == COLUMN_NAMES
    assert list(raw["step"]) == [0, 1, 2, 3, 4, 3, 4, 5, 6, 1, 2]


def test_records_are_parquet_and_missing_columns_stay_empty(tmp_path):
    rec = RunRecorder(tmp_path, None, {"job_name": "x"})
    rec.step(**row(0))
    rec.step(step=1, t_step=0.5)  # missing columns are left empty (NaN), not invented
    assert rec.finish("preempted").name == "steps.parquet"
    df = read_steps(tmp_path)
    assert df.loc[0, "t_fwd"] == 0.3 and df["t_fwd"].isna()[1] and df.loc[1, "t_step"] == 0.5
    assert read_meta(tmp_path)["status"] == "preempted"


def test_schema_errors(tmp_path):
    rec = RunRecorder(tmp_path, None, {})
    with pytest.raises(KeyError, match="unknown column"):
        rec.step(step=0, t_stepp=1.0)
    with pytest.raises(KeyError, match="'step' is required"):
        rec.step(t_step=1.0)
    with pytest.raises(ValueError, match="finish status"):
        rec.finish("great")
    rec.step(**row(0))
    rec.finish()
    path = tmp_path / "records/rank-00000.csv"
    (tmp_path / "steps.parquet").unlink()
    plain = path.read_text()
    # files of older versions start with a schema tag line and carry "# resume" lines
    path.write_text("# hpcpar.run steps schema_version=1\n" + plain + "# resume 2026\n")
    assert read_steps(tmp_path).equals(records.read_rank_file(tmp_path / "records" / path.name))
    path.write_text("# hpcpar.run steps schema_version=9\n" + plain)
    with pytest.raises(RunDirError, match=r"rank-00000.csv: schema version 9, this hpcpar reads"):
        read_steps(tmp_path)
    path.write_text(plain.replace("t_step", "t_stepp"))
    with pytest.raises(RunDirError, match=r"rank-00000.csv: not an hpcpar step record"):
        read_steps(tmp_path)
    meta = json.loads((tmp_path / "meta.json").read_text())
    meta["schema_version"] = 99
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RunDirError, match="schema version 99"):
        read_meta(tmp_path)
    with pytest.raises(RunDirError, match="missing"):
        read_meta(tmp_path / "nope")


def test_counters_map_and_schema_doc():
    delta = {"t_halo": 1.0, "t_graph_halo": 0.5, "bytes_read": 3, "t_allreduce_total": 2.0}
    assert records.row_from_counters(delta) == {"t_halo": 1.5, "bytes_read": 3,
                                                "t_allreduce_total": 2.0}
    doc = records.schema_markdown()
    assert all(f"`{c}`" in doc for c in COLUMN_NAMES)
    guide = Path(__file__).resolve().parents[2] / "docs/guides/analysis.md"
    assert doc in guide.read_text()  # the guide's schema table is the generated one
    slurm = records.slurm_facts({"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert slurm == {"job_id": "42", "node_list": "n[1-2]"}


@mpi_case(nprocs=(2,), timeout=60)
def test_mpi_recorder(comm):
    from hpcpar import ProcessGrid

    grid = ProcessGrid(data=-1, comm=comm)
    with shared_tmpdir(comm, prefix="hpcpar-rec-") as tmp:
        rec = RunRecorder(tmp, grid, {"job_name": "mpi"})
        for s in range(4):
            rec.step(**row(s, scale=1.0 + comm.rank))
        out = rec.finish("ok")
        if comm.rank == 0:
            df = read_steps(tmp)
            assert out.name == "steps.parquet" and len(df) == 8
            assert list(df["rank"]) == [0, 1] * 4
            assert df[df["rank"] == 1]["t_fwd"].tolist() == [0.6] * 4
            meta = read_meta(tmp)
            assert meta["ranks"] == 2 and meta["grid_spec"] == "2x1x1x1"
            assert len(meta["rank_hosts"]) == 2
