"""Launch decisions (mpiexec / srun / direct), rank info from Slurm/Open MPI/PMI variables,
the srun command line, and the signal contract constants."""

import signal

import pytest

from hpcpar.errors import EXIT_REQUEUE, ConfigError, LaunchError
from hpcpar.launch.launcher import (
    default_ranks,
    launch_command,
    plan_launch,
    rank_argv,
)
from hpcpar.parallel.placement import rank_info
from hpcpar.run.signals import STOP_SIGNALS

SLURM_ALLOC = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "8", "SLURM_CPUS_PER_TASK": "4"}
SLURM_STEP = {**SLURM_ALLOC, "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
              "SLURM_NTASKS_PER_NODE": "4"}


def test_plan_launch_modes():
    assert plan_launch(4, {}) == "mpiexec"
    assert plan_launch(1, {}) == "direct"
    assert plan_launch(8, SLURM_ALLOC) == "srun"
    assert plan_launch(1, {**SLURM_ALLOC, "SLURM_STEP_ID": "batch"}) == "srun"
    assert plan_launch(8, SLURM_STEP) == "direct"
    assert plan_launch(2, {"PMI_SIZE": "2", "PMI_RANK": "1"}) == "direct"
    assert plan_launch(3, {"OMPI_COMM_WORLD_SIZE": "3"}) == "direct"
    assert plan_launch(4, {"HPCPAR_LAUNCH": "mpiexec", **SLURM_ALLOC}) == "mpiexec"
    with pytest.raises(LaunchError, match="already running under MPI with 2 ranks"):
        plan_launch(4, {"PMI_SIZE": "2"})
    with pytest.raises(ConfigError, match="HPCPAR_LAUNCH='ssh': expected one of direct, srun"):
        plan_launch(4, {"HPCPAR_LAUNCH": "ssh"})


def test_rank_info_sources():
    assert rank_info(SLURM_STEP) == (5, 1, 8, 4)
    assert rank_info({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                      "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) \
        == (3, 1, 6, 2)
    assert rank_info({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2",
                      "MPI_LOCALNRANKS": "4"}) == (2, 2, 4, 4)
    # outside a step the batch shell's SLURM_PROCID is not a rank of ours
    assert rank_info({**SLURM_ALLOC, "SLURM_PROCID": "0", "PMI_RANK": "1", "PMI_SIZE": "2"}) \
        == (1, 0, 2, 1)
    assert rank_info({}) == (0, 0, 1, 1)
    assert default_ranks(SLURM_ALLOC) == 8 and default_ranks({}) is None
    assert default_ranks(SLURM_STEP) == 8


def test_commands():
    argv = rank_argv("R/job.json", "R", True)
    assert argv[1:] == ["-m", "hpcpar.run.trainer", "R/job.json", "--run-dir", "R", "--resume"]
    cmd = launch_command("srun", 8, argv, cpus_per_task=2, gpus_per_node=4,
                         env={**SLURM_ALLOC, "HPCPAR_SRUN_MPI": "pmi2",
                              "HPCPAR_SRUN_FLAGS": "--cpu-bind=cores"})
    assert cmd[:7] == ["srun", "--ntasks=8", "--cpus-per-task=4", "--kill-on-bad-exit=1",
                       "--mpi=pmi2",   # the wheel's netmod and provider (WHEEL_SRUN_ENV)
                       "--export=ALL,MPIR_CVAR_CH4_NETMOD=ofi,FI_PROVIDER=tcp",
                       "--gpus-per-task=1"]
    assert cmd[7] == "--cpu-bind=cores" and cmd[8:] == argv
    # the user's netmod or provider, or the user's own --export, wins
    cmd = launch_command("srun", 2, argv, env={**SLURM_ALLOC, "MPIR_CVAR_CH4_NETMOD": "ucx"})
    assert "--export=ALL,FI_PROVIDER=tcp" in cmd, cmd
    cmd = launch_command("srun", 2, argv, env={**SLURM_ALLOC, "FI_PROVIDER": "verbs",
                                               "MPIR_CVAR_CH4_NETMOD": "ofi"})
    assert not any(a.startswith("--export") for a in cmd), cmd
    cmd = launch_command("srun", 2, argv, env={**SLURM_ALLOC, "HPCPAR_SRUN_FLAGS": "--export=NONE"})
    assert not any(a.startswith("--export=ALL") for a in cmd), cmd
    cmd = launch_command("srun", 2, argv, cpus_per_task=3, env={"HPCPAR_SRUN_MPI": ""})
    assert cmd[:4] == ["srun", "--ntasks=2", "--cpus-per-task=3", "--kill-on-bad-exit=1"]
    assert "--gpus-per-task=1" not in cmd
    cmd = launch_command("mpiexec", 4, argv, env={})
    assert cmd[-len(argv) - 2:] == ["-n", "4", *argv]
    assert launch_command("direct", 1, argv) == argv


def test_signal_contract():
    assert EXIT_REQUEUE == 3
    assert set(STOP_SIGNALS) == {signal.SIGUSR1, signal.SIGTERM}
