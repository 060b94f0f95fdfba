"""The load generator's latency percentiles, against values counted by hand."""
import pytest

from dflash_ir.serve.loadgen import percentile


@pytest.mark.parametrize("values, p, want", [
    (list(range(1, 11)), 50, 5), (list(range(1, 11)), 90, 9), (list(range(1, 11)), 99, 10),
    ([3.0, 1.0, 2.0], 50, 2.0), ([3.0, 1.0, 2.0], 1, 1.0), ([7.5], 99, 7.5),
])
def test_nearest_rank_percentile(values, p, want):
    assert percentile(values, p) == want
