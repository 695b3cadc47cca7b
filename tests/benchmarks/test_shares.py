"""The offline yardstick splits a cell the way the endpoint's replicas share it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from benchmarks.serve_offline import share_of


@given(conc=st.integers(1, 64), per=st.integers(1, 8), replicas=st.integers(1, 4))
def test_shares_cover_the_cell_once(conc: int, per: int, replicas: int) -> None:
    n = conc * per
    shares = [share_of(conc, n, replicas, k) for k in range(replicas)]
    assert sum(c for c, _, _ in shares) == conc
    assert sum(m for _, m, _ in shares) == n
    offset = 0
    for c, m, first in shares:
        assert first == offset and (m == 0) == (c == 0)
        offset += m


def test_one_request_in_flight_is_served_by_one_process() -> None:
    assert [share_of(1, 4, 2, k) for k in range(2)] == [(1, 4, 0), (0, 0, 4)]
    assert [share_of(32, 64, 2, k) for k in range(2)] == [(16, 32, 0), (16, 32, 32)]
