"""A private single-node Slurm cluster for the tests (Debian's slurmctld/slurmd + munge).

``slurm_cluster`` is a session-scoped pytest fixture: it writes a ``slurm.conf`` into a temporary
directory, starts munged (own key and socket), slurmctld and slurmd there, waits for the node to be
idle, and at the end of the session stops exactly the PIDs it started. Client commands must see
``SLURM_CONF``: use :meth:`SlurmCluster.env` / :meth:`SlurmCluster.run`. Where Slurm cannot start
the tests skip (under ``CI=true`` they fail: CI installs it, .ci/setup.d/10-slurm.sh).

Configuration (Slurm 22.05 as root without cgroups): proctrack/pgid + task/none, select/cons_tres so
jobs share the node, no scheduling delay, kill_invalid_depend, more CPUs advertised than present
(config_overrides), jobcomp/filetxt instead of slurmdbd. ``python -m hpcpar.testing.slurm`` starts
one by hand. Also here: the helpers of the sbatch/Slurm tests and their ``shipped_profiles_only``
fixture (not autouse: other tests keep the real HOME)."""

from __future__ import annotations

import atexit
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Self, TypeVar

import pytest

from hpcpar.launch.submit import parse_scontrol, plan_submit, submit
from hpcpar.run.workloads.base import register_workload

__all__ = ["DAEMONS", "NODE_CPUS", "SlurmUnavailable", "slurm_conf", "SlurmCluster",
           "write_test_job", "write_stub_python", "read_argv", "shipped_profiles_only",
           "slurm_cluster"]

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "srun", "sinfo")
NODE_CPUS = 8
PARTITION = "debug"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be started here (the reason is the message)."""


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _find(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def _tool(name: str) -> str:
    """The path of a program :meth:`SlurmCluster.start` has checked is installed."""
    path = _find(name)
    assert path is not None, f"{name} is not installed"
    return path


def slurm_conf(root: Path, node: str, ports: list[int], munge_socket: Path,
               first_job_id: int, nodes: list[tuple[str, str]] | None = None,
               controller_addr: str = "127.0.0.1", cpus: int = NODE_CPUS,
               slurmd_timeout: int = 300) -> str:
    """The cluster's slurm.conf: one node ``node`` at 127.0.0.1 in partition ``debug``, or ``nodes``
    [(name, address), ...] with the controller on this host at ``controller_addr``. Job ids start at
    a random ``first_job_id``: MPICH names its shared memory after "jobid.stepid", and segments
    leaked by an earlier session's job 1 would hang this one's."""
    nodes = nodes or [(node, "127.0.0.1")]
    names = ",".join(name for name, _ in nodes)
    node_lines = "".join(
        f"NodeName={name} NodeAddr={addr} CPUs={cpus} Sockets=1 CoresPerSocket={cpus} "
        f"ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN\n" for name, addr in nodes)
    per_node = "" if len(nodes) == 1 else ".%n"
    return f"""\
ClusterName=hpcpartest
FirstJobId={first_job_id}
SlurmctldHost={node}({controller_addr})
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool{per_node.replace('.', '/')}
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd{per_node}.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd{per_node}.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
DependencyParameters=kill_invalid_depend
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=600
KillWait=5
SlurmdTimeout={slurmd_timeout}
InactiveLimit=0
Waittime=0
MessageTimeout=20
{node_lines}PartitionName={PARTITION} Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """A running private cluster: its directory, slurm.conf and the PIDs it started."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]
        self.partition = PARTITION
        self.pids: dict[str, int] = {}

    # -- clients ---------------------------------------------------------------------------
    def env(self, base: dict | None = None) -> dict:
        """An environment for client commands (and ``hpcpar submit``) aimed at this cluster."""
        env = dict(os.environ if base is None else base)
        for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            del env[key]
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, *args: str, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(args), env=self.env(), capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): "
                               f"{proc.stderr.strip()}")
        return proc

    def queued(self) -> list[str]:
        """Ids of the jobs still queued or running."""
        return self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()

    def cancel_all(self, timeout: float = 60) -> list[str]:
        """Cancel every job still queued or running and wait until none is left (so one
        failed test does not leave a job behind for the next); returns their ids."""
        ids = self.queued()
        if ids:
            self.run("scancel", *ids, check=False)
            wait_for(lambda: not self.queued(), timeout, f"jobs {ids} not cancelled", self)
        return ids

    def sbatch(self, *args: str) -> str:
        """Submit with ``sbatch --parsable``; return the job id."""
        return self.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict (one dict; for an array the first task)."""
        return self.jobs(job_id)[0]

    def jobs(self, job_id: str) -> list[dict]:
        out = self.run("scontrol", "show", "job", "--oneliner", str(job_id)).stdout
        return [parse_scontrol(line) for line in out.splitlines() if line.strip()]

    def wait(self, job_id: str, timeout: float = 120, states=TERMINAL) -> dict:
        """Poll until every job (array task) of ``job_id`` is in ``states``; return the first."""
        deadline = time.monotonic() + timeout
        while True:
            jobs = self.jobs(job_id)
            if all(j.get("JobState") in states for j in jobs):
                return jobs[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout}s: "
                                   + "; ".join(f"{j['JobId']} {j.get('JobState')} "
                                               f"{j.get('Reason')}" for j in jobs)
                                   + "\n" + self.log_tail())
            time.sleep(0.25)

    def log_tail(self, n: int = 15) -> str:
        parts = []
        for path in [self.root / "slurmctld.log", *sorted(self.root.glob("slurmd*.log"))]:
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()[-n:]
                parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # -- life cycle ------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> Self:
        missing = [d for d in DAEMONS + CLIENTS if not _find(d)]
        if missing:
            raise SlurmUnavailable(f"Slurm/munge not installed (missing {', '.join(missing)}; "
                                   "see .ci/setup.d/10-slurm.sh)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("the private Slurm cluster needs root (slurmd as root)")
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        try:
            sock = self._start_munged()
            self.conf.write_text(slurm_conf(self.root, self.node, _free_ports(2), sock,
                                            random.randrange(10_000, 60_000_000)))
            self._start_slurmctld(timeout)
            self._spawn("slurmd", [_tool("slurmd"), "-D", "-N", self.node, "-f", str(self.conf)])
            self._until(self._node_ready, timeout, f"node {self.node} to become idle")
        except BaseException:
            self.stop()  # a half-started cluster leaves nothing running
            raise
        return self

    def _start_munged(self) -> Path:
        """munged with its own key and socket under the cluster's folder; the socket path."""
        munge_dir = self.root / "munge"
        munge_dir.mkdir(parents=True, exist_ok=True)
        munge_dir.chmod(0o700)
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        sock = munge_dir / "munge.socket"
        self._spawn("munged", [_tool("munged"), "-F", "-f", f"--socket={sock}",
                               f"--key-file={key}", f"--log-file={munge_dir}/munged.log",
                               f"--pid-file={munge_dir}/munged.pid",
                               f"--seed-file={munge_dir}/munged.seed"])
        self._until(lambda: sock.exists(), 10, "munged socket")
        return sock

    def _start_slurmctld(self, timeout: float) -> None:
        self._spawn("slurmctld", [_tool("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._until(lambda: self.run("scontrol", "ping", check=False).returncode == 0,
                    timeout, "slurmctld to answer")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.stdout", "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.pids[name] = proc.pid
        self._procs = getattr(self, "_procs", {})
        self._procs[name] = proc

    def _until(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            for name, proc in getattr(self, "_procs", {}).items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with {proc.returncode} while waiting "
                                           f"for {what}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"timed out waiting for {what}:\n{self.log_tail()}")
            time.sleep(0.2)

    def _node_ready(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()
        return out.startswith("idle") or out.startswith("mixed")

    def stop(self) -> None:
        """Cancel the jobs, stop the daemons this object started (by PID), then end any job
        process of this cluster that outlived them (found by its SLURM_CONF). The temporary
        directory is left to its owner (pytest's tmp_path_factory)."""
        procs = getattr(self, "_procs", {})
        if not procs:
            return
        if "slurmctld" in procs and procs["slurmctld"].poll() is None:
            with suppress(subprocess.TimeoutExpired):  # a silent controller is stopped below
                self.run("scancel", "--full", check=False, timeout=10)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    q = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10)
                    if q.returncode != 0 or not q.stdout.strip():
                        break
                    time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        procs.clear()
        for pid in self._leftover_pids():
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self._remove_mpich_segments()

    def _remove_mpich_segments(self, steps: int = 8) -> None:
        """Delete the /dev/shm segments MPICH leaves when ranks exit without MPI_Finalize
        (checkpoint exits, kills). MPICH names them ``mpich_shm_<FNV-1a of "jobid.stepid">_*``;
        only this cluster's job ids (random, from jobcomp) are touched."""
        comp = self.root / "jobcomp.txt"
        if not comp.exists():
            return
        for job_id in set(re.findall(r"JobId=(\d+)", comp.read_text(errors="replace"))):
            for step in range(steps):
                h = 0x811C9DC5
                for byte in f"{job_id}.{step}".encode():
                    h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
                for seg in Path("/dev/shm").glob(f"mpich_shm_{h:x}_*"):
                    seg.unlink(missing_ok=True)

    def _leftover_pids(self) -> list[int]:
        """slurmstepd and job processes started for this cluster (their environment names
        this cluster's slurm.conf)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if mark in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                continue
        return pids


# -- helpers shared by the sbatch/Slurm tests ---------------------------------------------------
TEST_KIND = "sbatch-test"
TEST_JOB = """\
# a job file for the sbatch tests: validated by hpcpar, never trained (kind sbatch-test)
[job]
name = "cosmo"
[model]
kind = "sbatch-test"
[train]
steps = 10
global_batch = 64
"""

# Stands in for ``python`` in rendered scripts (no torch start-up): records its argv (NUL
# separated) and Slurm variables into the run dir (--run-dir, or -o for the report), then
# behaves as `--set job.name=...` says: fail -> exit 1; preempt -> on the first start wait
# for SIGUSR1, "checkpoint" and exit 3, on a restart finish.
STUB_PYTHON = r"""#!/bin/bash
out=""; prev=""
for a in "$@"; do
    if [ "$prev" = --run-dir ] || [ "$prev" = -o ]; then out=$a; fi
    prev=$a
done
mkdir -p "$out"
tag="${SLURM_PROCID:-0}.${SLURM_RESTART_COUNT:-0}"
printf '%s\0' "$@" > "$out/argv.$tag"
env | grep -E '^SLURM_(PROCID|LOCALID|NTASKS|ARRAY_TASK_ID|JOB_ID|RESTART_COUNT|CPUS_PER_TASK|STEP_ID)=' | sort > "$out/env.$tag"
case "$*" in
    *job.name=fail*) exit 1 ;;
    *job.name=preempt*)
        if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then
            trap 'touch "$out/checkpointed.$tag"; exit 3' USR1
            touch "$out/ready.$tag"
            while :; do sleep 0.1; done
        fi ;;
esac
exit 0
"""  # noqa: E501 (a bash script: its grep line stays one line)


# -- submitting, waiting, preempting (shared by the Slurm test modules) ---------------------
def submit_job(cluster, sandbox, out, **kw) -> list[dict]:
    """``hpcpar submit`` (the library call) into ``cluster``; python defaults to the stub."""
    kw.setdefault("python", sandbox["python"])
    return submit(plan_submit(kw.pop("job", sandbox["job"]), out, **kw), out, env=cluster.env())


def wait_for(pred, timeout: float, what: str, cluster=None) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout}s" +
                               (f"\n{cluster.log_tail()}" if cluster else ""))
        time.sleep(0.1)


def requeue_now(cluster, job_id: str, timeout: float = 60) -> None:
    """Wait for the requeued job to be pending and its previous batch step to be cleaned up
    on the node (what Slurm's requeue start delay waits for), then start it now."""
    def requeued():
        info = cluster.job(job_id)
        return info["JobState"] == "PENDING" and info.get("Restarts", "0") != "0"

    wait_for(requeued, timeout, "job not requeued", cluster)
    wait_for(lambda: not any(cluster.root.glob(f"spool/**/job{job_id}")), timeout,
              "previous batch step not cleaned up", cluster)
    # slurmd refuses a job id whose credential it revoked in the same second ("Job credential
    # revoked", seen on multi-node requeues): Slurm's own requeue delay avoids it; so do we
    time.sleep(2)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")


def _job_processes(out: Path) -> str:
    """State and kernel wait channel of the job's processes (srun, slurmstepd, the ranks):
    which one keeps a step from ending."""
    ps = subprocess.run(["ps", "-eo", "pid,ppid,stat,wchan:28,etime,args"],
                        capture_output=True, text=True).stdout.splitlines()
    keep = [ps[0], *(line for line in ps[1:] if str(out) in line or "slurmstepd" in line
                     or " srun " in f" {line} ")]
    return "\n".join(line[:240] for line in keep)


def usr1_then_resume(cluster, rec: dict, out: Path, timeout: float, started) -> str:
    """Once ``started()``, USR1 the batch shell; the job must requeue itself, restart once
    and complete. Returns the job's log."""
    wait_for(started, timeout, "job never reached the point to interrupt", cluster)
    cluster.run("scancel", "--batch", "--signal=USR1", rec["id"])
    path = out / "slurm" / f"{rec['label']}-{rec['id']}.out"
    try:
        requeue_now(cluster, rec["id"])
    except TimeoutError as exc:  # say what the job printed, where it is, what still runs
        log = path.read_text() if path.exists() else "(no job log)"
        raise TimeoutError(f"{exc}\n--- job {cluster.job(rec['id'])}\n--- job log\n"
                           f"{log[-6000:]}\n--- processes\n{_job_processes(out)}") from None
    info = cluster.wait(rec["id"], timeout)
    log = path.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", \
        (info, log, cluster.log_tail(40))
    return log


TINY_STEPS = 120  # long enough (~5 s of steps) that a USR1 always lands mid-run


def tiny_job(data_dir: Path) -> list[str]:
    """The CosmoFlow demo shrunk to seconds: 2 data-parallel ranks, 8^3 volumes."""
    return ["grid.data=2", "grid.x=1", "model.n_conv_blocks=2", "model.base_filters=2",
            "model.dense=[8]", f"data.path={data_dir}", "data.size=8", "data.samples=16",
            "data.shards=2", "data.val_samples=0", f"train.steps={TINY_STEPS}",
            "train.global_batch=2",
            "train.val_every=0", "train.warmup_steps=0", "train.log_every=1",
            "checkpoint.every=8", "checkpoint.keep=2", "resources.tasks_per_node=2"]


def register_test_kind() -> None:
    """A model kind without parameters, so job validation does not depend on real models."""
    class SbatchTestKind:
        model_params: dict = {}
        data_params: dict = {}

    register_workload(TEST_KIND, SbatchTestKind)


def write_test_job(path: Path) -> Path:
    register_test_kind()
    path.write_text(TEST_JOB)
    return path


def write_stub_python(path: Path) -> Path:
    path.write_text(STUB_PYTHON)
    path.chmod(0o755)
    return path


def read_argv(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\0")[:-1]


@pytest.fixture()
def shipped_profiles_only(tmp_path, monkeypatch):
    """Only hpcpar's own site profiles and templates: no ~/.config/hpcpar, no HPCPAR_*_PATH."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HPCPAR_SITE_PATH", raising=False)
    monkeypatch.delenv("HPCPAR_TEMPLATE_PATH", raising=False)


_CLUSTER: SlurmCluster | None = None
_Cluster = TypeVar("_Cluster", bound=SlurmCluster)


def start_or_skip(cluster: _Cluster, what: str) -> _Cluster:
    """Start ``cluster`` (a failed start cleans up after itself) for a test. Where it cannot start
    here (not root, packages missing) the test skips with the reason, naming the cluster as
    ``what``; under ``CI=true`` it fails, because CI installs them."""
    try:
        return cluster.start()
    except SlurmUnavailable as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{what} must run in CI: {exc}", pytrace=False)
        pytest.skip(f"no {what} here: {exc}")


@pytest.fixture(scope="session")
def slurm_cluster(request, tmp_path_factory) -> SlurmCluster:
    """One private cluster per test session (shared by every module that uses it)."""
    global _CLUSTER
    if _CLUSTER is None:
        root = Path(tempfile.mkdtemp(prefix="slurm-", dir=tmp_path_factory.getbasetemp()))
        cluster = start_or_skip(SlurmCluster(root), "Slurm")
        request.addfinalizer(cluster.stop)
        _CLUSTER = cluster
    return _CLUSTER


if __name__ == "__main__":  # start one by hand: python -m hpcpar.testing.slurm
    c = SlurmCluster(Path(tempfile.mkdtemp(prefix="slurm-"))).start()
    print(f"export SLURM_CONF={c.conf}   # Ctrl-C stops the cluster")
    try:
        signal.pause()
    except KeyboardInterrupt:
        c.stop()
