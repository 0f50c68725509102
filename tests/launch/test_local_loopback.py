"""A local ``mpiexec`` run stays on the loopback interface (issue 35): hydra gets ``-iface lo``
and the ranks' network endpoints are told to use ``lo``, only for a run on this host alone.
Checked on the command line and by a real 2-rank run whose ranks list the sockets they listen
on."""

import json
import sys
import textwrap

from hpcpar.launch.launcher import LOOPBACK_ENV, launch_command, run_ranks
from hpcpar.launch.mpiexec import find_mpiexec, rank_env

ARGV = [sys.executable, "-c", "pass"]

#: Run in every rank: the sum of the ranks, and the addresses of the TCP sockets this rank
#: listens on that its parent (hydra's proxy, whose control port every rank inherits) does not.
RANK = textwrap.dedent("""
    import json, os, socket, struct, sys
    from mpi4py import MPI

    def inodes(pid):
        found = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                found.add(link[8:-1])
        return found

    comm = MPI.COMM_WORLD
    total = comm.allreduce(comm.rank + 1)
    own = inodes(os.getpid()) - inodes(os.getppid())
    listening = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in open(f"/proc/net/{table}").read().splitlines()[1:]:
            cells = line.split()
            if cells[3] == "0A" and cells[9] in own:  # 0A: LISTEN
                raw = bytes.fromhex(cells[1].split(":")[0])
                words = struct.unpack("<" + "I" * (len(raw) // 4), raw)
                listening.append(socket.inet_ntop(family, struct.pack(">" + "I" * len(words),
                                                                      *words)))
    found = comm.gather({"sum": total, "listening": listening})
    if comm.rank == 0:
        open(sys.argv[1], "w").write(json.dumps(found))
""")


def test_local_command_binds_loopback_only_when_alone_on_this_host():
    mpiexec = find_mpiexec()
    cmd = launch_command("mpiexec", 2, ARGV, env={})
    flags = ["-iface", "lo", *(w for k, v in LOOPBACK_ENV.items() for w in ("-genv", k, v))]
    assert cmd == [mpiexec, *flags, "-n", "2", *ARGV]
    # the user's own interface wins; a run that may span hosts is left alone
    cmd = launch_command("mpiexec", 2, ARGV, env={"UCX_NET_DEVICES": "eth0"})
    assert "UCX_NET_DEVICES" not in cmd and cmd[1:3] == ["-iface", "lo"]
    for remote in ({"HYDRA_HOST_FILE": "hosts"}, {"SLURM_JOB_ID": "7"}):
        assert launch_command("mpiexec", 2, ARGV, env=remote) == [mpiexec, "-n", "2", *ARGV]
    assert launch_command("srun", 2, ARGV, env={"HPCPAR_SRUN_MPI": ""})[0] == "srun"


def test_real_two_rank_run_listens_on_loopback_only(tmp_path):
    script, result = tmp_path / "rank.py", tmp_path / "ranks.json"
    script.write_text(RANK)
    env = rank_env()
    for name in (*LOOPBACK_ENV, "HYDRA_HOST_FILE", "SLURM_JOB_ID"):
        env.pop(name, None)
    cmd = launch_command("mpiexec", 2, [sys.executable, str(script), str(result)], env=env)
    assert run_ranks(cmd, env) == 0
    ranks = json.loads(result.read_text())
    assert [r["sum"] for r in ranks] == [3, 3]
    addresses = {a for r in ranks for a in r["listening"]}
    assert addresses <= {"127.0.0.1", "::1"}, ranks
