"""Machine files written by ``hpcpar plan --calibrate -o M.toml`` (``Machine.to_toml``) read
back as the same machine, whatever text the name and description hold: a quote, a backslash
or a newline once ended the string early and left a file ``load_machine`` refused."""

import tomllib

from hpcpar.plan.machine import Link, Machine, load_machine

AWKWARD = ('lab "B" cluster', "C:\\hpc\\node", "line one\nline two = 3\n[inter]", "tab\tdel\x7f")


def test_machine_file_round_trips_awkward_text(tmp_path):
    for i, text in enumerate(AWKWARD):
        m = Machine(text, ranks_per_node=4, flops=2.5e12, mem_bw=1.3e12, mem_per_rank=40e9,
                    io_bw=1e9, intra=Link(3e-6, 80e9), inter=Link(4e-6, 20e9),
                    description=AWKWARD[-1 - i], cores=64, conv_rates=((4, 1e11), (64, 2e12)),
                    layer_costs=(("pool", 1e-10), ("bn", 2e-10)), conv_grid=((4, 8, 1e11),))
        text_out = m.to_toml()
        doc = tomllib.loads(text_out)
        assert doc["name"] == text and doc["description"] == AWKWARD[-1 - i]
        path = tmp_path / f"m{i}.toml"
        path.write_text(text_out)
        assert load_machine(str(path)) == m
