"""File formats, below the runtime: the job spec (schema, reading, validation, TOML and JSON
Schema output), the model-kind registry a job is validated against, and the run-record format
(schema, writer, reader), and who owns a run or sweep directory (its mark, its lock, rerun
policy: ``rundir.py``). Tools that only read or write files (launch, plan, analysis, the CLI)
go through here and never import the training loop.

May import: hpcpar.errors, hpcpar.parallel (the grid's axes and shape rule).
"""
