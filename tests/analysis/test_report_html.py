"""The report's HTML comes from one Jinja template with autoescaping on, and its tables from
one formatter: a job named like markup is shown as text, and every Markdown table (the
report's, the record schema's) is aligned, its column rules at the same place on every line."""

import re

from hpcpar.analysis import synthetic_run, write_report
from hpcpar.formats.records import schema_markdown

NAME = "<script>alert('x')</script>&co"


def aligned(table_lines):
    bars = [tuple(m.start() for m in re.finditer(r"(?<!\\)\|", line)) for line in table_lines]
    return len(set(bars)) == 1 and len(bars) > 2


def test_markup_in_a_job_name_is_escaped_and_tables_align(tmp_path):
    for p in (1, 2):
        synthetic_run(tmp_path / "sweep" / f"ranks-{p}", grid=(1, p, 1, 1), steps=4,
                      t_step=4.0 / p, meta={"config": NAME, "job_name": NAME})
    rep = write_report([tmp_path / "sweep"], tmp_path / "out")
    page = rep.files["report.html"].read_text()
    assert "<script>" not in page and "alert(" in page
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;co" in page
    assert re.search(r"<td>&lt;script&gt;alert\(&#39;x&#39;\)&lt;/script&gt;&amp;co</td>"
                     r"<td>2</td>", page)
    md = rep.files["report.md"].read_text()
    tables = re.findall(r"(?m)(?:^\|.*\|\n)+", md)
    assert len(tables) >= 5 and all(aligned(t.splitlines()) for t in tables), md
    assert NAME in rep.headline and aligned(rep.headline.splitlines())
    schema = [line for line in schema_markdown().splitlines() if line.startswith("|")]
    assert aligned(schema)
