"""Starting and submitting jobs: mpiexec/srun launch, sbatch rendering, site profiles,
submission and sweeps; runs in the user's shell, not in the ranks.

May import: hpcpar.errors, hpcpar.parallel, hpcpar.formats, hpcpar.run.
"""
