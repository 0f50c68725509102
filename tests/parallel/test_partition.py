"""hpcpar.parallel.partition against brute force (hypothesis property tests) and torch's own
lengths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcpar.parallel import partition as P

FAST = settings(max_examples=120, deadline=None)
sizes = st.integers(0, 60)
parts = st.integers(1, 9)


def brute_parts(n, p):
    """Deal items one by one to the currently smallest earliest part, then lay out in order."""
    counts = [0] * p
    for _ in range(n):
        counts[counts.index(min(counts))] += 1
    return counts


@FAST
@given(sizes, parts)
def test_split_rule(n, p):
    got = P.split_sizes(n, p)
    assert got == brute_parts(n, p)
    ranges = P.part_ranges(n, p)
    assert [b - a for a, b in ranges] == got
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(p - 1))
    for item in range(n):
        i = P.owner(n, p, item)
        assert ranges[i][0] <= item < ranges[i][1]


@st.composite
def stencils(draw):
    """Any kernel/stride/dilation; padding up to beyond the kernel's reach (conv allows it)."""
    k = draw(st.integers(1, 6))
    d = draw(st.integers(1, 3))
    s = draw(st.integers(1, 4))
    lo = draw(st.integers(0, d * (k - 1) + 2))
    hi = draw(st.integers(0, d * (k - 1) + 2))
    return k, s, lo, hi, d


def brute_windows(n, k, s, lo, hi, d):
    """Windows (as input index lists) whose every tap lies in the padded input."""
    out, o = [], 0
    while s * o - lo + d * (k - 1) <= n - 1 + hi:
        out.append([s * o - lo + d * t for t in range(k)])
        o += 1
    return out


@FAST
@given(st.integers(1, 40), stencils())
def test_output_length_and_input_range(n, st_):
    k, s, lo, hi, d = st_
    wins = brute_windows(n, k, s, lo, hi, d)
    assert P.stencil_output_length(n, k, s, lo, hi, d) == len(wins)
    for a in range(len(wins)):
        for b in range(a + 1, min(len(wins), a + 4) + 1):
            taps = [i for w in wins[a:b] for i in w]
            assert P.stencil_input_range(a, b, k, s, lo, d) == (min(taps), max(taps) + 1)


@FAST
@given(st.integers(1, 40), st.integers(1, 5), st.integers(1, 4), st.integers(0, 2),
       st.integers(1, 2), st.booleans())
def test_output_length_matches_torch(n, k, s, p, d, ceil):
    if p > k // 2:
        p = 0
    x = torch.zeros(1, 1, n)
    try:
        m = F.max_pool1d(x, k, s, p, d, ceil_mode=ceil).shape[-1]
    except RuntimeError:
        m = 0  # torch refuses an output of size 0
    assert P.stencil_output_length(n, k, s, p, p, d, ceil) == m
    if not ceil:
        try:
            m = F.conv1d(x, torch.zeros(1, 1, k), stride=s, padding=p, dilation=d).shape[-1]
        except RuntimeError:
            m = 0
        assert P.stencil_output_length(n, k, s, p, p, d) == m


@FAST
@given(st.integers(1, 40), parts, stencils(), st.data())
def test_conv_axis_halo_brute(n, p, st_, data):
    k, s, lo, hi, d = st_
    i = data.draw(st.integers(0, p - 1))
    h = P.conv_axis_halo(n, p, i, k, s, lo, hi, d)
    wins = brute_windows(n, k, s, lo, hi, d)
    assert h.n_out == len(wins)
    assert h.owned == P.part_range(n, p, i) and h.out == P.part_range(len(wins), p, i)
    taps = [t for w in wins[h.out[0]:h.out[1]] for t in w]
    if not taps:
        assert h.needed[0] == h.needed[1] and h.halo_lo == -(h.owned[1] - h.owned[0])
        return
    lo_t, hi_t = min(taps), max(taps) + 1  # the ranges are hulls (dilation gaps included)
    assert (h.pad_lo, h.pad_hi) == (max(0, min(hi_t, 0) - lo_t), max(0, hi_t - max(lo_t, n)))
    c0, c1 = max(lo_t, 0), min(hi_t, n)
    if c1 <= c0:  # windows read padding only
        assert h.needed[0] == h.needed[1]
        return
    assert h.needed == (c0, c1)
    assert all(c0 <= t < c1 for t in taps if 0 <= t < n)
    assert h.halo_lo == h.owned[0] - c0 and h.halo_hi == c1 - h.owned[1]


@FAST
@given(st.integers(1, 30), parts, st.integers(1, 5), st.integers(1, 4), st.integers(0, 4),
       st.integers(0, 3), st.integers(1, 3), st.data())
def test_transposed_halo_brute(n, p, k, s, pad, opad, d, data):
    pad = min(pad, d * (k - 1))
    opad = min(opad, max(s, d) - 1)
    m = P.transposed_output_length(n, k, s, pad, opad, d)
    if m < 1:
        return  # torch refuses it too
    x = torch.zeros(1, 1, n)
    assert m == F.conv_transpose1d(x, torch.zeros(1, 1, k), stride=s, padding=pad,
                                   output_padding=opad, dilation=d).shape[-1]
    i = data.draw(st.integers(0, p - 1))
    h = P.transposed_axis_halo(n, p, i, k, s, pad, opad, d)
    feeds = [j for j in range(-k - 2, n + k + 2)
             if any(h.out[0] <= s * j - pad + d * t < h.out[1] for t in range(k))]
    if h.out[1] == h.out[0]:
        return
    lo, hi = P.transposed_input_range(*h.out, k, s, pad, d)
    if feeds:
        assert lo <= min(feeds) and max(feeds) < hi  # no contributing input missed
        real = [j for j in feeds if 0 <= j < n]
        if real:
            assert h.needed[0] <= min(real) and max(real) < h.needed[1]


def test_same_padding_matches_torch():
    for k in range(1, 6):
        for d in (1, 2, 3):
            lo, hi = P.same_padding(k, d)
            x = torch.randn(1, 1, 11)
            w = torch.randn(1, 1, k)
            ref = F.conv1d(x, w, padding="same", dilation=d)
            got = F.conv1d(F.pad(x, (lo, hi)), w, dilation=d)
            assert torch.allclose(ref, got)


def test_bad_arguments():
    with pytest.raises(ValueError):
        P.split_sizes(3, 0)
    with pytest.raises(ValueError):
        P.part_range(3, 2, 2)
    with pytest.raises(ValueError):
        P.owner(3, 2, 3)
