"""A workload whose steps wait at a gate the test holds: requests pile up at one step boundary."""

import os
import time
from pathlib import Path

from workloads import light_cnn  # beside this file

from tunekit.workload import Workload

GATE = "TUNEKIT_TEST_GATE"
"""A file: while it exists, no rank starts a new step (its batch waits for its data); each
rank held there says so with a file beside it, ``GATE.held-rankN``."""


def gated_cnn() -> Workload:
    """light_cnn whose batches wait while the file named by $TUNEKIT_TEST_GATE exists."""
    w = light_cnn()
    make = w.make_batch
    gate = Path(os.environ[GATE])

    held = gate.with_name(f"{gate.name}.held-rank{os.environ.get('RANK', '0')}")

    def make_batch(n, gen):
        if gate.exists():
            held.touch()  # the test waits for every rank to be held before it queues requests
            while gate.exists():
                time.sleep(0.05)
            held.unlink(missing_ok=True)
        return make(n, gen)

    w.make_batch = make_batch
    return w
