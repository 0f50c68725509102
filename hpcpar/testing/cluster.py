"""A virtual multi-node Slurm cluster on one machine: each node is its own set of Linux namespaces,
running its own ``slurmd``.

A node is a network namespace (its own address on a private bridge that exists only inside this
machine) plus UTS (hostname ``node1`` ... ``nodeN``), IPC, mount (a private ``/dev/shm`` and
node-local scratch, :attr:`VirtualCluster.local_dir`) and PID namespaces, entered by its ``slurmd``.
So, as on a real cluster, ranks on one node share memory and ranks on different nodes cannot (MPI
talks TCP over the bridge), and a node whose ``slurmd`` dies takes every process on it along.
``slurmctld`` and ``munged`` run on this host (the bridge's last address); client commands work from
here with ``SLURM_CONF`` set. ``--link RATE[,DELAY]`` shapes every node's link with ``tc`` (``tbf``;
``netem`` for the delay, where the kernel has it).

The bridge has no uplink and the nodes no route beyond its subnet. Everything made is recorded in a
state file, so ``down`` (or the next ``up``, after a crash) removes exactly that.

By hand (as root)::

    python -m hpcpar.testing.cluster up --nodes 4 --link 2gbit,50us   # prints export SLURM_CONF=...
    python -m hpcpar.testing.cluster down"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

import pytest

from hpcpar.testing.slurm import (
    DAEMONS,
    SlurmCluster,
    SlurmUnavailable,
    _find,
    _free_ports,
    slurm_conf,
    start_or_skip,
)

__all__ = ["VirtualCluster", "teardown", "virtual_cluster"]

TOOLS = ("ip", "tc", "nsenter", "unshare")
STATE_FILE = Path("/run/hpcpar-vcluster.json")
NODE_CPUS = 4
SLURMD_TIMEOUT = 10  # seconds until a silent node is declared down (its jobs end)
SUBNET = "10.251"  # 10.251.<net>.0/24, <net> picked free on this host; the host is .254


class ClusterBusy(SlurmUnavailable):
    """A virtual cluster is already up (``down`` it first)."""


def parse_link(text: str | None) -> tuple[str | None, str | None]:
    """``"2gbit,50us"`` -> ("2gbit", "50us"); ``"2gbit"`` -> ("2gbit", None)."""
    if not text:
        return None, None
    rate, _, delay = text.partition(",")
    if not re.fullmatch(r"\d+(\.\d+)?([kmg]?bit|[kmg]?bps)", rate.strip(), re.I):
        raise ValueError(f"--link {text!r}: expected RATE[,DELAY] such as 2gbit,50us")
    if delay and not re.fullmatch(r"\d+(\.\d+)?(us|ms|s)", delay.strip()):
        raise ValueError(f"--link {text!r}: DELAY must look like 50us or 1ms")
    return rate.strip(), (delay.strip() or None)


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise SlurmUnavailable(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class VirtualCluster(SlurmCluster):
    """``nodes`` virtual nodes (``node1`` ...) behind one private bridge, one Slurm partition;
    ``root`` holds slurm.conf, logs and spool files (removed by :meth:`stop`). ``link``:
    ``RATE[,DELAY]`` of every node's link (None: unshaped); ``cpus`` each node advertises (more than
    the host has is fine); ``state_file`` records the running cluster (one per machine)."""

    def __init__(self, root: Path, nodes: int = 2, link: str | None = None,
                 cpus: int = NODE_CPUS, state_file: Path = STATE_FILE):
        super().__init__(root)
        if nodes < 1:
            raise ValueError(f"--nodes {nodes}: expected at least 1")
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.rate, self.delay = parse_link(link)
        self.cpus = cpus
        self.state_file = Path(state_file)
        self.id = f"{random.randrange(16 ** 4):04x}"
        self.bridge = f"hpcb{self.id}"
        self.net: int | None = None
        self.netns = {n: f"hpc{self.id}{n}" for n in self.nodes}
        self.veth = {n: f"hpc{self.id}v{i}" for i, n in enumerate(self.nodes, 1)}
        self.notes: list[str] = []
        self.local_dir = self.root / "local"  # each node mounts its own tmpfs here

    # -- addresses -----------------------------------------------------------------------
    def address(self, node: str) -> str:
        """The node's address on the bridge (``10.251.<net>.<i>``)."""
        return f"{SUBNET}.{self.net}.{self.nodes.index(node) + 1}"

    @property
    def host_address(self) -> str:
        return f"{SUBNET}.{self.net}.254"

    def _free_net(self) -> int:
        used = _sh("ip", "-4", "-o", "addr", "show").stdout + _sh("ip", "-4", "route").stdout
        free = [n for n in range(1, 250) if f"{SUBNET}.{n}." not in used]
        if not free:
            raise SlurmUnavailable(f"no free {SUBNET}.N.0/24 subnet for the bridge")
        return random.choice(free)

    # -- life cycle ------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> VirtualCluster:
        """Make the bridge, the nodes and the daemons; wait until every node is
        idle. :class:`ClusterBusy` when another virtual cluster is up on this machine;
        :class:`SlurmUnavailable` when not root, a tool is missing, or a daemon would not start (the
        message says which; everything made so far is removed again)."""
        missing = [t for t in DAEMONS + TOOLS if not _find(t)]
        if missing:
            raise SlurmUnavailable(f"missing {', '.join(missing)} (Debian: slurmd slurmctld "
                                   "munge iproute2 util-linux; see .ci/setup.d/10-slurm.sh)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("the virtual cluster needs root (network namespaces)")
        reclaim_stale(self.state_file)
        if self.state_file.exists():
            raise ClusterBusy(f"a virtual cluster is already up (state in {self.state_file}); "
                              "run `python -m hpcpar.testing.cluster down` first")
        self.net = self._free_net()
        self._record()  # before anything is made, so a crash half-way is still cleaned up
        try:
            self._make_network()
            self._start_daemons(timeout)
        except BaseException:
            self.stop()
            raise
        self._record()
        return self

    def _make_network(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for node in self.nodes:
            ns, veth = self.netns[node], self.veth[node]
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", veth, "master", self.bridge, "up")
            for argv in (("ip", "addr", "add", f"{self.address(node)}/24", "dev", "eth0"),
                         ("ip", "link", "set", "eth0", "up"), ("ip", "link", "set", "lo", "up")):
                self.in_netns(node, *argv)
            self._shape(node)

    def _shape(self, node: str) -> None:
        """Rate (tbf) and delay (netem) on the node's egress; a kernel without netem gets
        the rate only, and :attr:`notes` says so."""
        if self.delay:
            spec = ["netem", "delay", self.delay] + (["rate", self.rate] if self.rate else [])
            if self.in_netns(node, "tc", "qdisc", "add", "dev", "eth0", "root", *spec,
                             check=False).returncode == 0:
                return
            note = f"link delay {self.delay} not applied: this kernel has no netem qdisc"
            if note not in self.notes:
                self.notes.append(note)
        if self.rate:
            self.in_netns(node, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                          self.rate, "burst", "256kb", "latency", "50ms")

    def _start_daemons(self, timeout: float) -> None:
        for sub in ("state", "munge", "local", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        sock = self._start_munged()
        self.conf.write_text(slurm_conf(
            self.root, self.node, _free_ports(2), sock, random.randrange(10_000, 60_000_000),
            nodes=[(n, self.address(n)) for n in self.nodes], controller_addr=self.host_address,
            cpus=self.cpus, slurmd_timeout=SLURMD_TIMEOUT))
        self._start_slurmctld(timeout)
        for node in self.nodes:
            # the node's init (PID 1 of its PID namespace) runs slurmd and reaps orphans; when
            # slurmd goes, init goes, and with it every process on the node
            script = (f"mount -t tmpfs -o size=50% tmpfs /dev/shm && "
                      f"mount -t tmpfs -o size=25% tmpfs {self.local_dir} && "
                      f"hostname {node} && exec {sys.executable} -m hpcpar.testing._node_init "
                      f"{_find('slurmd')} -D -N {node} -f {self.conf}")
            self._spawn(f"slurmd-{node}", ["nsenter", f"--net=/var/run/netns/{self.netns[node]}",
                                           "unshare", "--uts", "--ipc", "--mount", "--pid",
                                           "--fork", "--mount-proc", "--kill-child=SIGTERM",
                                           "sh", "-c", script])
        self._until(self._nodes_ready, timeout, f"nodes {','.join(self.nodes)} to become idle")

    def _nodes_ready(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n, "").startswith(("idle", "mixed", "alloc")) for n in self.nodes)

    def _record(self) -> None:
        self.state_file.write_text(json.dumps({
            "root": str(self.root), "conf": str(self.conf), "bridge": self.bridge,
            "netns": list(self.netns.values()), "veth": list(self.veth.values()),
            "pids": {name: proc.pid for name, proc in getattr(self, "_procs", {}).items()},
            "nodes": {n: self.address(n) for n in self.nodes} if self.net else {},
            "link": [self.rate, self.delay], "notes": self.notes}, indent=1))

    def stop(self) -> None:
        """Cancel the jobs, stop the daemons started here, remove namespaces, bridge, files
        and the state file. Safe to call twice."""
        try:
            super().stop()
        finally:  # whatever happened above, nothing this cluster made stays behind
            teardown(json.loads(self.state_file.read_text()) if self.state_file.exists() else {
                "root": str(self.root), "bridge": self.bridge, "netns": list(self.netns.values()),
                "veth": list(self.veth.values()), "pids": {}})
            self.state_file.unlink(missing_ok=True)

    # -- acting on nodes -------------------------------------------------------------------
    def in_netns(self, node: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run ``argv`` in the node's network namespace (``ip``/``tc`` work; no hostname)."""
        return _sh("nsenter", f"--net=/var/run/netns/{self.netns[node]}", *argv, check=check)

    def init_pid(self, node: str) -> int:
        """PID (as seen here) of the node's init, PID 1 of the node: the child of ``unshare``."""
        return _children(self._procs[f"slurmd-{node}"].pid)[0]

    def node_pids(self, node: str) -> list[int]:
        """Every process on the node (its PID namespace), as PIDs seen here."""
        target = os.readlink(f"/proc/{self.init_pid(node)}/ns/pid")
        pids = []
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and os.readlink(d / "ns/pid") == target:
                    pids.append(int(d.name))
            except OSError:
                continue
        return pids

    def node_files(self, node: str, path: Path) -> list[str]:
        """Names of the files under ``path`` as the node sees them (its own mounts), sorted."""
        out = _sh("nsenter", "-t", str(self.init_pid(node)), "-m", "find", str(path),
                  "-type", "f", "-printf", "%P\\n").stdout
        return sorted(out.split())

    def link_down(self, node: str) -> None:
        """Cut the node off the network (its processes keep running, unreachable)."""
        _sh("ip", "link", "set", self.veth[node], "down")

    def kill_node(self, node: str) -> None:
        """The node dies: its init, slurmd and every process on it are killed at once."""
        os.kill(self.init_pid(node), signal.SIGKILL)


def _children(pid: int) -> list[int]:
    try:
        return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _kill(pids, grace: float = 10) -> None:
    """SIGTERM to every live PID, then SIGKILL to those still there after ``grace`` s."""
    pids = [p for p in pids if _alive(p)]
    for pid in pids:
        with suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def teardown(state: dict) -> None:
    """Remove what a state record says was made: processes (by PID), namespaces, veths, the
    bridge and the cluster's folder. Only names and PIDs from the record are touched."""
    pids = state.get("pids", {})
    # nodes first, through their slurmd (PID 1 of the node: the whole node goes with it);
    # the ``unshare`` above it ignores SIGTERM and exits when its child does
    nodes = [pid for name, pid in pids.items() if name.startswith("slurmd-")]
    _kill([kid for pid in nodes for kid in _children(pid)])
    _kill(list(pids.values()))
    for ns in state.get("netns", []):
        if Path(f"/var/run/netns/{ns}").exists():
            _sh("ip", "netns", "del", ns, check=False)
    for link in state.get("veth", []) + [state.get("bridge")]:
        if link and Path(f"/sys/class/net/{link}").exists():
            _sh("ip", "link", "del", link, check=False)
    root = state.get("root")
    if root and Path(root).is_dir():
        shutil.rmtree(root, ignore_errors=True)


def reclaim_stale(state_file: Path = STATE_FILE) -> bool:
    """A state file whose daemons are all gone (an interrupted session): clean up after it.
    True when something was reclaimed."""
    if not state_file.exists():
        return False
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        state_file.unlink(missing_ok=True)
        return True
    if any(_alive(pid) for pid in state.get("pids", {}).values()):
        return False
    teardown(state)
    state_file.unlink(missing_ok=True)
    return True


_SESSION: VirtualCluster | None = None


@pytest.fixture(scope="session")
def virtual_cluster(request, tmp_path_factory) -> VirtualCluster:
    """One 4-node virtual cluster per test session, links shaped to 2 Gbit/s. Where it cannot
    start the tests skip with the reason; under ``CI=true`` they fail instead."""
    global _SESSION
    if _SESSION is None:
        root = Path(tempfile.mkdtemp(prefix="vcluster-", dir=tmp_path_factory.getbasetemp()))
        cluster = start_or_skip(VirtualCluster(root, nodes=4, link="2gbit"), "the virtual cluster")
        atexit.register(cluster.stop)  # an interrupted session still tears it down
        request.addfinalizer(cluster.stop)
        _SESSION = cluster
    return _SESSION


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcpar.testing.cluster",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a virtual cluster; prints the SLURM_CONF to export")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--link", default=None, metavar="RATE[,DELAY]",
                    help="shape every node's link, e.g. 2gbit,50us")
    up.add_argument("--cpus", type=int, default=NODE_CPUS, help="CPUs each node advertises")
    sub.add_parser("down", help="stop the virtual cluster and remove everything it made")
    sub.add_parser("status", help="print the running cluster's state record")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            root = Path(tempfile.mkdtemp(prefix="hpcpar-vcluster-"))
            try:
                cluster = VirtualCluster(root, args.nodes, args.link, args.cpus).start()
            except BaseException:
                if not STATE_FILE.exists() or str(root) not in STATE_FILE.read_text():
                    shutil.rmtree(root, ignore_errors=True)
                raise
            for note in cluster.notes:
                print(f"# note: {note}", file=sys.stderr)
            print(f"export SLURM_CONF={cluster.conf}")
            return 0
        if not STATE_FILE.exists():
            print("no virtual cluster is up", file=sys.stderr)
            return 0 if args.command == "down" else 1
        if args.command == "status":
            print(STATE_FILE.read_text())
            return 0
        state = json.loads(STATE_FILE.read_text())
        if _alive(state.get("pids", {}).get("slurmctld")):
            with suppress(subprocess.TimeoutExpired):
                subprocess.run(["scancel", "--full", "--user=root"], capture_output=True,
                               env={**os.environ, "SLURM_CONF": state["conf"]}, timeout=20)
        teardown(state)
        STATE_FILE.unlink(missing_ok=True)
        print("virtual cluster down")
        return 0
    except (SlurmUnavailable, ValueError) as exc:
        print(f"hpcpar.testing.cluster: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
