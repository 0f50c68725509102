"""``hpcpar run JOB --print-config`` writes a TOML job file that reads back into the same job
for any text a job holds: TOML's own escapes (a DEL character, quotes, backslashes, newlines)
and the comments users read (the source, the unset keys) survive."""

import tomllib
from pathlib import Path

from hpcpar.formats.jobspec import load_job

DEMO = Path(__file__).resolve().parents[2] / "jobs" / "demo-cosmoflow.toml"


def test_print_config_escapes_every_string(run_cli, tmp_path):
    text = DEMO.read_text().replace(
        'description = "', 'description = "del\\u007f quote\\" newline\\n back\\\\ ', 1)
    job = tmp_path / "awkward.toml"
    job.write_text(text)
    rc, out, err = run_cli(["run", str(job), "--print-config"])
    assert rc == 0, err
    want = load_job(job).to_dict()
    assert tomllib.loads(out)["job"]["description"] == want["job"]["description"]
    assert out.startswith(f"# resolved from {job} by hpcpar\n")
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(out)
    assert load_job(resolved).to_dict() == want
    unset = [f"{s}.{k}" for s, values in want.items() for k, v in values.items() if v is None]
    assert unset and all(f"# {key.split('.')[1]} = (unset)" in out for key in unset)
