"""Starting and submitting jobs: mpiexec/srun launch, sbatch rendering, site profiles, submission
and sweeps; runs in the user's shell, not in the ranks.

May import: hpcpar.errors, hpcpar.parallel, hpcpar.formats (never hpcpar.run: a sweep locks and
marks its directory with the run directory's format)."""
