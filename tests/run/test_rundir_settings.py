"""A run directory's job.json written before keys were added resumes without a "settings
differ" error (the new keys take their defaults); a real change is still reported."""

import json

from hpcpar.formats import rundir
from hpcpar.formats.jobspec import build_job


def test_new_keys_at_default_are_not_a_change(tmp_path):
    raw = {"model": {"kind": "cosmoflow"},
           "data": {"source": "synthetic", "size": 32, "channels": 1},
           "train": {"steps": 3}}
    job = build_job(raw).to_dict()
    old = json.loads(json.dumps(job))
    del old["profile"]
    del old["output"]["tensorboard"]
    (tmp_path / "job.json").write_text(json.dumps({"source": "j.toml", "job": old}))
    assert rundir.check_settings(tmp_path, job) == []
    changed = build_job(raw, ["train.steps=5"]).to_dict()
    assert [d[0] for d in rundir.check_settings(tmp_path, changed)] == ["train.steps"]
