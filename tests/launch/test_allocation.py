"""Reading a Slurm allocation's hosts and srun's rank placement from its environment."""

import pytest

from hpcpar.errors import LaunchError
from hpcpar.launch.allocation import expand_hostlist, rank_hosts, tasks_per_node


def test_hostlist_syntax():
    assert expand_hostlist("node[1-3,7],gpu[08-10]x,login") == [
        "node1", "node2", "node3", "node7", "gpu08x", "gpu09x", "gpu10x", "login"]
    assert expand_hostlist("a[1-2]b[3-4]") == ["a1b3", "a1b4", "a2b3", "a2b4"]
    assert expand_hostlist("single") == ["single"]
    for bad in ("node[1-", "node[a-b]", "node]1["):
        with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST"):
            expand_hostlist(bad)


def test_tasks_per_node_and_block_placement():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE"):
        tasks_per_node("two")
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2],m", "SLURM_TASKS_PER_NODE": "2,1(x2)"}
    assert rank_hosts(env) == ["n1", "n1", "n2", "m"]
    assert rank_hosts({}) is None
    with pytest.raises(LaunchError, match="names 3 hosts"):
        rank_hosts({**env, "SLURM_TASKS_PER_NODE": "2"})
