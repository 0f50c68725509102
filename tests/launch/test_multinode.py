"""hpcpar across real (virtual) nodes: each node its own network, hostname, /dev/shm and PID
namespace, ranks placed by Slurm's ``srun``, MPI between nodes over TCP.

The session's cluster (``virtual_cluster``, hpcpar.testing.cluster) has 4 nodes with 2 Gbit/s
links; most jobs use two of them. Every job here runs under a time bound; a hang fails the
test, it never blocks CI.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpcpar.launch.launcher import wheel_srun_export
from hpcpar.launch.submit import plan_submit, submit
from hpcpar.testing.cluster import VirtualCluster, _alive
from hpcpar.testing.slurm import (
    TINY_STEPS,
    start_or_skip,
    tiny_job,
    usr1_then_resume,
    wait_for,
)

pytestmark = pytest.mark.slurm


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(request):
    """A failed test's job is cancelled, so the next test starts on an empty cluster."""
    yield
    if "virtual_cluster" in request.fixturenames:
        request.getfixturevalue("virtual_cluster").cancel_all()


def srun(cluster, script: str, tmp_path: Path, nodes: int = 2, per_node: int = 2,
         env: dict | None = None, timeout: float = 120, wait: bool = True, args=(),
         python: str = sys.executable):
    """Run ``script`` (Python source, with ``args``) as an MPI job over ``nodes`` x
    ``per_node`` ranks."""
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    # the wheel's ranks get what hpcpar's own srun launches give them (its OFI netmod)
    wheel = wheel_srun_export({}) if python == sys.executable else []
    argv = ["srun", f"--nodes={nodes}", f"--ntasks-per-node={per_node}", "--mpi=pmi2",
            *wheel, "--kill-on-bad-exit=1", f"--chdir={tmp_path}", python, str(path),
            *map(str, args)]
    full_env = {**cluster.env(), "OMP_NUM_THREADS": "1", **(env or {})}
    if not wait:
        return subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    return subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=timeout)


def results(tmp_path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]


GRID_AND_SYNC = """
    import json, socket
    import torch
    from torch import nn
    import hpcpar

    grid = hpcpar.ProcessGrid(data=2, x=2)
    host = socket.gethostname()
    spatial_hosts = grid.spatial_comm.allgather(host)
    node_hosts = grid.node_comm.allgather(host)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(37, 515), nn.Tanh(), nn.Linear(515, 23), nn.Tanh(),
                             nn.Linear(23, 4))

    g = torch.Generator().manual_seed(1)
    B, P = 3, grid.size
    xs = torch.randn(B * P, 37, generator=g) * (1 + 1000 * (torch.arange(B * P) // B))[:, None]
    ys = torch.randn(B * P, 4, generator=g)
    r = grid.rank

    def grads(**kw):
        m = model()
        world = hpcpar.ProcessGrid(data=P)
        ddp = hpcpar.DDP(m, world, bucket_cap_mb=2e-3, first_bucket_mb=5e-4, **kw)
        nn.functional.mse_loss(ddp(xs[r * B:(r + 1) * B]), ys[r * B:(r + 1) * B]).backward()
        return ddp.hierarchical, [p.grad.clone() for p in m.parameters()]

    flat_h, flat = grads(hierarchical=False)
    hier_h, hier = grads(hierarchical=True)
    auto_h, auto = grads()
    ref = model()
    nn.functional.mse_loss(ref(xs), ys).backward()
    err = max(((a - p.grad).abs().max() / p.grad.abs().max()).item()
              for a, p in zip(hier, ref.parameters()))
    json.dump({"rank": r, "host": host, "node_index": grid.node_index,
               "num_nodes": grid.num_nodes, "ranks_per_node": grid.ranks_per_node,
               "spatial_hosts": spatial_hosts, "node_hosts": node_hosts,
               "flags": [flat_h, hier_h, auto_h],
               "bitwise": all(torch.equal(a, b) and torch.equal(a, c)
                              for a, b, c in zip(flat, hier, auto)),
               "rel_err_vs_single": err}, open(f"rank{r}.json", "w"))
"""


def test_grid_nodes_and_hierarchical_sync_over_real_nodes(virtual_cluster, tmp_path):
    """The node split comes from the real hosts; spatial groups sit inside a node; the
    hierarchical gradient sync equals the flat one bitwise and the single process to fp32
    rounding."""
    proc = srun(virtual_cluster, GRID_AND_SYNC, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = results(tmp_path)
    assert len(res) == 4
    for r in res:
        assert r["num_nodes"] == 2 and r["ranks_per_node"] == 2
        assert r["host"] == f"node{r['node_index'] + 1}"
        assert set(r["node_hosts"]) == {r["host"]}
        assert set(r["spatial_hosts"]) == {r["host"]}, "a spatial group spans nodes"
        assert r["flags"] == [False, True, True]
        assert r["bitwise"], "hierarchical sync differs from the flat sync"
        # fp32, inputs up to 1000x apart, 12 samples summed in another order than one
        # process: measured 1.10e-5 on this round's tree (the three sync modes stay bitwise)
        assert r["rel_err_vs_single"] < 3e-5
    assert sorted(r["host"] for r in res) == ["node1", "node1", "node2", "node2"]


#: An environment whose mpi4py is built from source against the system's MPI (Debian's MPICH),
#: as the README tells cluster users to do with their site MPI; .ci/setup.d builds it.
SITE_MPI_VENV = Path(os.environ.get("MPIO_VENV", "/opt/hpcpar-mpio-venv"))


def test_srun_across_nodes_with_a_site_built_mpi(virtual_cluster, tmp_path):
    """The site-MPI path: mpi4py built against the system MPICH (not the pip wheel), ranks
    started by srun's pmi2 on two nodes; node split and hierarchical sync as with the wheel."""
    python = SITE_MPI_VENV / "bin" / "python"
    if not python.exists():
        why = f"{python} not found; .ci/setup.d/30-parallel-hdf5.sh builds it"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the site-MPI test must run in CI: {why}", pytrace=False)
        pytest.skip(why)
    script = GRID_AND_SYNC.replace(
        "    json.dump({", "    from mpi4py import MPI\n    json.dump({'library': "
        "MPI.Get_library_version().splitlines()[0], ")
    proc = srun(virtual_cluster, script, tmp_path, python=str(python))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = results(tmp_path)
    assert sorted(r["host"] for r in res) == ["node1", "node1", "node2", "node2"]
    for r in res:
        assert r["num_nodes"] == 2 and r["bitwise"] and r["rel_err_vs_single"] < 3e-5, r
    wheel = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; "
                            "print(MPI.Get_library_version().splitlines()[0])"],
                           capture_output=True, text=True, timeout=60).stdout.strip()
    assert {r["library"] for r in res} != {wheel}, "the venv ran the wheel's MPI"


STALL = """
    import os, signal
    import torch
    from torch import nn
    import hpcpar

    grid = hpcpar.ProcessGrid()
    torch.manual_seed(0)
    ddp = hpcpar.DDP(nn.Linear(4, 2), grid)
    for step in range(3):
        if grid.rank == 3 and step == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # a rank frozen on the second node
        ddp(torch.randn(2, 4)).sum().backward()
    print(f"rank {grid.rank} finished", flush=True)
"""


def test_stall_detector_names_a_stopped_rank_on_another_node(virtual_cluster, tmp_path):
    start = time.monotonic()
    proc = srun(virtual_cluster, STALL, tmp_path, env={"HPCPAR_STALL_TIMEOUT": "3"},
                timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "rank(s) 3 have not reached gradient sync #2" in out, out
    assert "finished" not in out, out
    assert time.monotonic() - start < 120


LOOP = """
    import os, signal, time
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    open(f"pid{comm.rank}", "w").write(f"{os.uname().nodename} {os.getpid()}")
    x = np.ones(1 << 16)
    for i in range(100000):
        comm.Allreduce(MPI.IN_PLACE, x)
        if i == 20 and comm.rank == int(os.environ["VICTIM"]):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.01)
"""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""


def _no_job_left(cluster) -> bool:
    return not cluster.queued()


CORA = """
    import json, sys
    from mpi4py import MPI
    from hpcpar.graph import DistGraph
    from hpcpar.testing.oracles import load_cora, train_cora

    comm = MPI.COMM_WORLD
    g = DistGraph.from_hdf5(sys.argv[1], comm, method="metis", row_normalize=True)
    dist = train_cora(g, seed=2)
    single = None
    if comm.rank == 0:
        e, x, y, masks = load_cora()
        single = train_cora(DistGraph.from_global(e, x.shape[0], x, MPI.COMM_SELF, y=y,
                                                  masks=masks), seed=2)
    json.dump({"rank": comm.rank, "dist": dist, "single": comm.bcast(single)},
              open(f"rank{comm.rank}.json", "w"))
"""


def test_gcn_on_cora_across_two_nodes_matches_one_rank(virtual_cluster, tmp_path):
    """Full-graph GCN training (Kipf & Welling, 200 epochs) on a METIS-partitioned Cora over
    2 nodes x 2 ranks: the same validation and test accuracy as one process."""
    from hpcpar.graph.format import import_npz
    from hpcpar.testing.oracles import CORA_NPZ

    graph = tmp_path / "cora.h5"
    import_npz(str(CORA_NPZ), str(graph))
    proc = srun(virtual_cluster, CORA, tmp_path, args=(graph,), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = results(tmp_path)
    assert len(res) == 4
    for r in res:
        for split in ("val_acc", "test_acc"):
            assert r["dist"][split] == r["single"][split], r
    assert res[0]["single"]["test_acc"] > 0.75


def test_kill9_of_a_rank_on_the_second_node_ends_the_job(virtual_cluster, tmp_path):
    start = time.monotonic()
    proc = srun(virtual_cluster, LOOP, tmp_path, env={"VICTIM": "3"}, timeout=90)
    took = time.monotonic() - start
    assert proc.returncode != 0
    assert took < 60, f"job took {took:.0f} s to go after a rank was killed"
    deadline = time.monotonic() + 30
    while not _no_job_left(virtual_cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _no_job_left(virtual_cluster)
    for node in virtual_cluster.nodes:  # no rank of the job left on any node
        left = [p for p in virtual_cluster.node_pids(node) if str(tmp_path) in _cmdline(p)]
        assert not left, (node, left)


def test_a_node_that_disappears_ends_the_job_without_a_hang(tmp_path):
    """A node whose slurmd and ranks all die mid-job: srun ends, naming the node's tasks or
    with the surviving ranks' MPI error, within 90 s."""
    cluster = start_or_skip(VirtualCluster(tmp_path / "c", nodes=2,
                                           state_file=tmp_path / "state.json"),
                            "the virtual cluster")
    try:
        (tmp_path / "job").mkdir()
        job = srun(cluster, LOOP, tmp_path / "job", env={"VICTIM": "-1"}, wait=False)
        deadline = time.monotonic() + 60
        while len(list((tmp_path / "job").glob("pid*"))) < 4:
            assert time.monotonic() < deadline and job.poll() is None, job.stdout.read()
            time.sleep(0.2)
        start = time.monotonic()
        cluster.kill_node("node2")
        out, _ = job.communicate(timeout=90)
        assert job.returncode != 0
        assert time.monotonic() - start < 90
        # srun names the lost node's tasks, or a rank on the surviving node reports the
        # broken connection first (the OFI netmod notices at once) and srun ends the step
        assert ("node2" in out or "task 2" in out or "task 3" in out
                or "Fatal error in internal_Allreduce" in out), out
    finally:
        cluster.stop()


def test_plan_calibrate_measures_the_network_between_nodes(virtual_cluster, tmp_path):
    """`hpcpar plan --calibrate` in a 2-node allocation measures both links (the shaped
    inter-node one slower than shared memory), sees that the virtual nodes share this host's
    cores, and `hpcpar plan` then reads the machine file."""
    from hpcpar.plan.machine import load_machine

    machine = tmp_path / "vcluster.toml"
    log = tmp_path / "calibrate.out"
    job = virtual_cluster.sbatch(
        "--nodes=2", "--ntasks-per-node=2", f"--output={log}", f"--chdir={tmp_path}", "--wrap",
        f"{sys.executable} -m hpcpar.cli plan --calibrate -o {machine}")
    info = virtual_cluster.wait(job, 600)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", text
    m = load_machine(str(machine))
    assert m.ranks_per_node == 2 and m.host_cores == (os.cpu_count() or 1), m
    assert "2 nodes, inter-node link measured" in m.description, m.description
    assert m.inter.beta < 0.5 * m.intra.beta and m.inter.alpha > m.intra.alpha, (m.intra,
                                                                               m.inter)
    assert m.inter.beta < 2e9 / 8 * 1.2, m.inter  # the 2 Gbit/s shaping, not shared memory
    # the compute tables: (in, out) channel grid, optimizer per parameter, threads
    assert len(m.conv_grid) == 49 and all(r > 0 for *_, r in m.conv_grid), m.conv_grid
    assert {k for k, _ in m.opt_costs} == {"sgd", "adam", "adamw"} and m.thread_speedup >= 1
    # fixed costs per call: the spatial layers, and a graph halo exchange between two ranks
    assert {k for k, _ in m.call_costs} == {"conv", "pool", "bn", "graph_halo"}, m.call_costs
    assert all(v > 0 for _, v in m.call_costs), m.call_costs


def test_teardown_is_complete_and_a_second_up_is_refused(virtual_cluster, tmp_path):
    state = tmp_path / "state.json"
    cluster = VirtualCluster(tmp_path / "c", nodes=1, state_file=state).start()
    made = json.loads(state.read_text())
    second = VirtualCluster(tmp_path / "d", nodes=1, state_file=state)
    with pytest.raises(Exception, match="already up"):
        second.start()
    pids = list(made["pids"].values())
    cluster.stop()
    assert not state.exists() and not (tmp_path / "c").exists()
    assert not any(_alive(p) for p in pids)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in netns for ns in made["netns"])
    for link in made["veth"] + [made["bridge"]]:
        assert not Path(f"/sys/class/net/{link}").exists(), link
    # a state file left by a killed session is reclaimed by the next start
    cluster = VirtualCluster(tmp_path / "e", nodes=1, state_file=state).start()
    made = json.loads(state.read_text())
    for pid in made["pids"].values():
        os.kill(pid, signal.SIGKILL)
    for pid in made["pids"].values():
        while _alive(pid):
            time.sleep(0.05)
    again = VirtualCluster(tmp_path / "f", nodes=1, state_file=state).start()
    assert not Path(f"/sys/class/net/{made['bridge']}").exists()
    again.stop()


def test_hpcpar_info_in_an_allocation_prints_hosts_per_rank(virtual_cluster, tmp_path):
    out = tmp_path / "info.out"
    job = virtual_cluster.sbatch("--nodes=2", "--ntasks-per-node=2", f"--output={out}",
                                 f"--chdir={tmp_path}", "--wrap",
                                 f"{sys.executable} -m hpcpar.cli info --grid 2x2x1x1")
    info = virtual_cluster.wait(job, 60)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED", text
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in
            (["0"], ["1"], ["2"], ["3"])]
    assert [(r[0], r[1], r[2], r[-1]) for r in rows] == [
        ("0", "0", "0", "node1"), ("1", "0", "1", "node1"), ("2", "1", "0", "node2"),
        ("3", "1", "1", "node2")], text


STAGE = """
    import json, os, sys
    import hpcpar
    from hpcpar.data import ShardedVolumeDataset

    grid = hpcpar.ProcessGrid(data=-1)
    ds = ShardedVolumeDataset(sys.argv[1], grid, grid.size, shuffle=False, prefetch=0,
                              stage_to=sys.argv[2])
    needed = sorted(ds.manifest.shards[i].file for i in ds._needed_shards())
    json.dump({"rank": grid.rank, "node": grid.node_index, "host": os.uname().nodename,
               "copied": ds.bytes_staged, "needed": needed}, open(f"rank{grid.rank}.json", "w"))
    ds.close()
"""


def test_staging_copies_each_file_once_per_node(virtual_cluster, tmp_path, run_cli):
    """stage_to on node-local disks (each node its own tmpfs): the first rank of each node
    copies the union of its node's shards, once; the other ranks copy nothing."""
    data = tmp_path / "data"
    code, _, err = run_cli(["data", "make", "cosmoflow", str(data), "--samples", "16",
                            "--size", "8", "--shards", "8", "--quiet"])
    assert code == 0, err
    local = virtual_cluster.local_dir
    proc = srun(virtual_cluster, STAGE, tmp_path, args=(data, local))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = results(tmp_path)
    sizes = {p.name: p.stat().st_size for p in data.glob("*.h5")}
    assert not list(local.iterdir()), "node-local files leaked onto the shared disk"
    for node in (0, 1):
        mine = [r for r in res if r["node"] == node]
        union = sorted(set().union(*(r["needed"] for r in mine)))
        assert [r["copied"] for r in mine] == [sum(sizes[f] for f in union), 0]
        staged = virtual_cluster.node_files(mine[0]["host"], local)
        assert sorted(os.path.basename(f) for f in staged if f.endswith(".h5")) == union


# -- real training over nodes: hpcpar submit --nodes, preemption, equality ----------------------
REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "jobs" / "demo-cosmoflow.toml"


def _spatial_tiny(data_dir: Path) -> list[str]:
    """The shrunk demo with one spatial group (x=2) per node, data parallel across nodes
    (a global batch of 4: one sample per data group at 4 nodes)."""
    return tiny_job(data_dir) + ["grid.data=-1", "grid.x=2", "train.global_batch=4"]


@pytest.fixture(scope="module")
def node_sweep(virtual_cluster, tmp_path_factory):
    """``hpcpar submit --nodes 1,2,4 --ranks-per-node 2 --report`` of the shrunk demo."""
    d = tmp_path_factory.mktemp("nodes")
    out = d / "sweep"
    recs = submit(plan_submit(DEMO, out, nodes=[1, 2, 4], ranks_per_node=2, report=True,
                              sets=_spatial_tiny(d / "data"), python=sys.executable),
                  out, env=virtual_cluster.env())
    for rec in recs:
        info = virtual_cluster.wait(rec["id"], 300)
        logs = "\n".join(p.read_text() for p in (out / "slurm").glob("*.out"))
        assert info["JobState"] == "COMPLETED", logs
    return d, out


def test_node_sweep_ends_in_one_report_with_a_nodes_column(node_sweep):
    import pandas as pd

    _, out = node_sweep
    table = pd.read_csv(out / "report" / "scaling.csv")
    assert sorted(zip(table["ranks"], table["nodes"])) == [(2, 1), (4, 2), (8, 4)]
    meta = json.loads((out / "ranks-4" / "meta.json").read_text())
    assert meta["nodes"] == 2 and meta["grid_spec"] == "2x2x1x1"
    assert len(set(meta["hostnames"])) == 2 and set(meta["hostnames"]) <= {
        "node1", "node2", "node3", "node4"}
    machine = meta["machine"]  # under Slurm: the node's CPUs as Slurm counts them
    got = [machine[k] for k in ("cores_per_node", "cores_source", "ranks_per_node",
                                "threads_per_rank", "oversubscribed")]
    assert got == [2, "SLURM_CPUS_ON_NODE", 2, 1, False], machine  # the 2 CPUs allocated


def _final(run: Path) -> dict:
    import torch

    return torch.load(run / f"checkpoints/step-{TINY_STEPS:06d}/model.pt", weights_only=True)


def test_two_node_preemption_requeue_resume_is_bit_identical(virtual_cluster, node_sweep):
    """USR1 to a 2-node job mid-run -> checkpoint -> requeue -> resume: the same final
    parameters, bit for bit, as the uninterrupted 2-node run."""
    import torch

    d, ref = node_sweep
    out = d / "preempt"
    [rec] = submit(plan_submit(DEMO, out, nodes=[2], ranks_per_node=2,
                               sets=_spatial_tiny(d / "data"), python=sys.executable),
                   out, env=virtual_cluster.env())
    run = out / "ranks-4"
    log = usr1_then_resume(virtual_cluster, rec, out, 300,
                           lambda: any((run / "checkpoints").glob("step-*")))
    meta = json.loads((run / "meta.json").read_text())
    assert len(meta["segments"]) == 2 and 0 < meta["segments"][1]["first_step"] < TINY_STEPS, log
    mine, want = _final(run), _final(ref / "ranks-4")
    assert mine.keys() == want.keys()
    for k in want:
        assert torch.equal(mine[k], want[k]), k


def test_kill9_of_a_training_rank_keeps_the_checkpoint_and_resume_is_exact(virtual_cluster,
                                                                          node_sweep):
    """kill -9 of one rank of a 2-node training job on the second node: the whole job is gone
    within 60 s, every checkpoint left verifies (sizes and sha256), and `hpcpar run` resumed
    from the newest ends with the same parameters, bit for bit, as the uninterrupted run."""
    import torch

    from hpcpar.run.checkpoint.store import list_checkpoints, verify

    d, ref = node_sweep
    out = d / "kill9"
    [rec] = submit(plan_submit(DEMO, out, nodes=[2], ranks_per_node=2,
                               sets=_spatial_tiny(d / "data"), python=sys.executable),
                   out, env=virtual_cluster.env())
    run = out / "ranks-4"
    wait_for(lambda: any((run / "checkpoints").glob("step-*")), 180, "no checkpoint",
             virtual_cluster)
    node = virtual_cluster.run("scontrol", "show", "hostnames",
                               virtual_cluster.job(rec["id"])["NodeList"]).stdout.split()[1]
    ranks = [p for p in virtual_cluster.node_pids(node)
             if str(run) in _cmdline(p) and "hpcpar.cli" in _cmdline(p)
             and "slurmstepd" not in _cmdline(p)]
    assert ranks, (node, virtual_cluster.job(rec["id"]))
    os.kill(max(ranks), signal.SIGKILL)
    start = time.monotonic()
    info = virtual_cluster.wait(rec["id"], 60)
    took = time.monotonic() - start
    assert info["JobState"] in ("FAILED", "CANCELLED"), info
    assert took < 60 and _no_job_left(virtual_cluster), took
    for n in virtual_cluster.nodes:  # no rank of the job left on any node
        assert not [p for p in virtual_cluster.node_pids(n) if str(run) in _cmdline(p)], n
    kept = list_checkpoints(run / "checkpoints")
    assert kept and all(verify(c)["step"] < TINY_STEPS for c in kept)
    last = int(kept[0].name.split("-")[1])
    again = d / "kill9-resume.out"
    cmd = " ".join([sys.executable, "-m", "hpcpar.cli", "run", str(DEMO), "--run-dir", str(run),
                    *[f"--set {s}" for s in _spatial_tiny(d / "data")]])
    job = virtual_cluster.sbatch("--nodes=2", "--ntasks-per-node=2", f"--output={again}",
                                 f"--chdir={d}", "--wrap", cmd)
    info = virtual_cluster.wait(job, 240)
    text = again.read_text()
    assert info["JobState"] == "COMPLETED", text
    assert f"resumed from step-{last:06d}" in text, text
    mine, want = _final(run), _final(ref / "ranks-4")
    assert mine.keys() == want.keys()
    for k in want:
        assert torch.equal(mine[k], want[k]), k


def test_spatial_and_data_parallel_over_nodes_equals_one_process(node_sweep, tmp_path):
    """The 2-node run (data across nodes, x split inside each node) trains the same model as
    one process on the whole batch, to fp32 rounding."""
    d, ref = node_sweep
    run = tmp_path / "one"
    proc = subprocess.run(
        [sys.executable, "-m", "hpcpar.cli", "run", str(DEMO), "-n", "1", "--grid", "1x1x1x1",
         "--run-dir", str(run), *[a for s in _spatial_tiny(d / "data") for a in ("--set", s)
                                  if not s.startswith("grid.")]],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    one, four = _final(run), _final(ref / "ranks-4")
    for k in one:
        if one[k].is_floating_point():
            err = ((four[k] - one[k]).abs().max() / one[k].abs().max().clamp_min(1e-12)).item()
            assert err < 1e-4, (k, err)


def test_job_that_loses_a_node_resumes_on_the_rest_with_a_smaller_data_axis(tmp_path):
    """A 2-node training job (grid 2x2x1x1) whose second node dies mid-run ends (no hang)
    with a message; `hpcpar run` on the remaining node resumes from its last checkpoint on
    grid 1x1x2x1 (checkpoints depend on neither the data width nor the spatial split: the
    volume is now split along y, not x) and finishes."""
    cluster = start_or_skip(VirtualCluster(tmp_path / "c", nodes=2,
                                           state_file=tmp_path / "state.json"),
                            "the virtual cluster")
    try:
        out = tmp_path / "sweep"
        sets = _spatial_tiny(tmp_path / "data")
        [rec] = submit(plan_submit(DEMO, out, nodes=[2], ranks_per_node=2, sets=sets,
                                   python=sys.executable), out, env=cluster.env())
        run = out / "ranks-4"
        wait_for(lambda: any((run / "checkpoints").glob("step-*")), 180, "no checkpoint",
                 cluster)
        cluster.kill_node("node2")
        # Slurm ends the step, then requeues the batch job (it asked for --requeue): it waits
        # for two nodes that are not there; the user cancels it and resumes on what is left
        deadline = time.monotonic() + 120
        while (info := cluster.job(rec["id"]))["JobState"] not in ("PENDING", "FAILED",
                                                                   "NODE_FAIL", "CANCELLED"):
            assert time.monotonic() < deadline, (info, cluster.log_tail())
            time.sleep(0.5)
        cluster.run("scancel", rec["id"])
        log = (out / "slurm" / f"ranks-4-{rec['id']}.out").read_text()
        assert "node2" in log, log
        done = json.loads((run / "meta.json").read_text())
        last = max(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
        assert last < TINY_STEPS and done["status"] != "ok"
        again = tmp_path / "again.out"
        cmd = " ".join([sys.executable, "-m", "hpcpar.cli", "run", str(DEMO), "--run-dir",
                        str(run), "--grid", "1x1x2x1", *[f"--set {s}" for s in sets]])
        job = cluster.sbatch("--nodes=1", "--ntasks-per-node=2", "--nodelist=node1",
                             f"--output={again}", f"--chdir={tmp_path}", "--wrap", cmd)
        info = cluster.wait(job, 240)
        text = again.read_text()
        assert info["JobState"] == "COMPLETED", text
        meta = json.loads((run / "meta.json").read_text())
        assert meta["status"] == "ok" and meta["grid_spec"] == "1x1x2x1", text
        assert meta["segments"][-1]["first_step"] == last, (meta["segments"], text)
        assert f"resumed from step-{last:06d}" in text, text
        assert (run / "checkpoints" / f"step-{TINY_STEPS:06d}").is_dir()
    finally:
        cluster.stop()
