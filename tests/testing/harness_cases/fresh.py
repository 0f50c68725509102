"""Checks that the process looks fresh to this module (tests/testing/test_harness.py)."""

import os
import warnings

import torch


def case_sees_a_fresh_process(comm):
    assert "HARNESS_CASES_LEAK" not in os.environ
    assert os.getcwd() != "/" and torch.get_default_dtype() == torch.float32
    assert torch.is_grad_enabled()
    assert torch.initial_seed() != 5, "the generator the other module seeded"
    assert not any(f[0] == "error" and f[2] is Warning for f in warnings.filters[:1])
    comm.Barrier()
