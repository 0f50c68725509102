"""Deliberately broken MPI cases, run only by tests/testing/test_harness.py (not collected)."""

import time

import pytest


def case_ok(comm):
    comm.Barrier()


def case_fails_on_last_rank(comm):
    if comm.Get_rank() == comm.Get_size() - 1:
        raise ValueError("deliberate failure on the last rank")
    comm.Barrier()  # the other ranks would wait here forever without the abort


def case_hangs_on_rank0(comm):
    if comm.Get_rank() == 0:
        time.sleep(3600)
    comm.Barrier()


def case_skips_on_rank0(comm):
    if comm.Get_rank() == 0:
        pytest.skip("deliberate skip on rank 0 only")


def case_after(comm):
    comm.Barrier()
