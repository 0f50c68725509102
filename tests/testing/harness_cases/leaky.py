"""A module that changes the process for whoever comes next (tests/testing/test_harness.py)."""

import os
import warnings

import torch

torch.set_default_dtype(torch.float64)   # at import, as some test modules do


def case_changes_the_process(comm):
    os.environ["HARNESS_CASES_LEAK"] = "1"
    os.chdir("/")
    torch.manual_seed(5)
    torch.set_grad_enabled(False)
    warnings.simplefilter("error")
    comm.Barrier()
