"""``broadcast_object`` carries JSON between ranks and never unpickles (issue 18, item 3)."""

import pytest
from support import rank_broadcasts_without_unpickling

from tunekit.testing import run_ranks


@pytest.mark.slow
@pytest.mark.busy_ok
def test_broadcast_object_sends_json_and_no_rank_unpickles():
    results = run_ranks(rank_broadcasts_without_unpickling, nproc=2)
    expected = [{"from": src, "plan": [1, 2.5, "x", None], "t": [1, 2]} for src in range(2)]
    assert results == [expected, expected]  # the sender too gets the JSON round trip
