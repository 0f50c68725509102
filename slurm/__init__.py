"""Slurm data files shipped with hpcpar: ``templates/*.sbatch`` and ``sites/*.toml``.

Installed as the data package ``hpcpar.slurm_files`` (setup.cfg ``package_dir``); in a source
checkout ``hpcpar.launch.site`` reads this folder directly. No code lives here.
"""
