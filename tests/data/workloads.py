"""Workloads for tests: good ones, broken ones, and ones that fail in training."""

import time

import torch
from torch import nn

from tunekit.examples.cnn import make_batch as cnn_batch
from tunekit.examples.cnn import workload as cnn_workload
from tunekit.workload import Workload


def tiny() -> Workload:
    """A two-layer MLP: trains in milliseconds."""

    def make_batch(n, gen):
        x = torch.randn(n, 16, generator=gen)
        return x, (x.sum(dim=1) > 0).long()

    return Workload(
        name="tiny",
        model=lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)),
        make_batch=make_batch,
        batch_size=8,
        lr=0.1,
        batch_range=(2, 64),
    )


def reports_its_start() -> Workload:
    """tiny, each rank writing to ``$TUNEKIT_TEST_REPORT_DIR`` whether ``torch._dynamo`` was
    loaded before the workload was built (a forked rank has it from its agent), whether it
    listens on its agent's store port (a forked rank must not hold the agent's socket) and,
    from an exit hook, that the hook ran."""
    import atexit
    import json
    import os
    import sys
    from pathlib import Path

    import psutil

    out = Path(os.environ["TUNEKIT_TEST_REPORT_DIR"])
    rank = os.environ["RANK"]
    master_port = int(os.environ["MASTER_PORT"])  # the agent's store
    listening = [
        c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"
    ]
    facts = {
        "dynamo_loaded": "torch._dynamo" in sys.modules,
        "ppid": os.getppid(),
        "holds_agents_port": master_port in listening,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(facts))
    atexit.register((out / f"rank{rank}.exit").write_text, "ran")
    return tiny()


def paced_tiny() -> Workload:
    """tiny, its batches waiting 20 ms for their data: a live job whose metrics grow by the
    same 50 steps a second on any machine (tiny alone made 400 a second on a fast one, and
    its metrics alone filled a 20 MiB disk within the test)."""
    w = tiny()
    make = w.make_batch

    def make_batch(n, gen):
        time.sleep(0.02)  # an input pipeline waiting on storage
        return make(n, gen)

    w.make_batch = make_batch
    return w


def column_targets() -> Workload:
    """Targets of shape (n, 1): cross_entropy cannot train on them (a common slip)."""
    w = tiny()
    make_batch = w.make_batch

    def batch(n, gen):
        x, y = make_batch(n, gen)
        return x, y.unsqueeze(1)

    w.make_batch = batch
    return w


class _Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 3:  # tunekit's observation runs three: trace, first step, summary
            raise RuntimeError("workload exploded on purpose")
        return self.fc(x)


class _Hangs(_Raises):
    def forward(self, x):
        self.calls += 1
        if self.calls > 2:
            while True:
                time.sleep(1)
        return self.fc(x)


def raises() -> Workload:
    """Builds fine, then raises in its fourth forward pass (inside training)."""
    w = tiny()
    w.model = _Raises
    return w


def hangs() -> Workload:
    """Builds fine, then never returns from its third forward pass."""
    w = tiny()
    w.model = _Hangs
    return w


def not_a_workload():
    return 42


def factory_fails():
    raise ValueError("cannot build this workload")


def cnn():
    return cnn_workload()


DATA_WAIT_S = 0.08
"""How long a paced workload's batch waits for its data: a live job of the demo CNN on 2
ranks then uses about a quarter of a core (0.63 of one at 30 ms), leaving the rest to the
trials and tests beside it, and still makes 8 steps a second."""


def light_cnn() -> Workload:
    """The demo CNN on small batches that wait for their data: a live job that
    leaves most of the CPU to the trials and tests running beside it."""
    w = paced_cnn()
    w.batch_size, w.batch_range = 8, (2, 64)
    return w


def paced_cnn() -> Workload:
    """The demo CNN (batch 32) whose batches wait for their data: a live job whose
    step-to-step loss is as steady as the demo's, at a quarter of a core."""
    w = cnn_workload()

    def make_batch(n, gen):
        time.sleep(DATA_WAIT_S)  # an input pipeline waiting on storage
        return cnn_batch(n, gen)

    w.make_batch = make_batch
    return w


def cnn_float64() -> Workload:
    """The demo CNN in float64: two runs of the same mathematics (a live job with
    and without a math-preserving apply) are compared at float64 precision."""
    w = cnn_workload()

    def make_batch(n, gen):
        images, labels = cnn_batch(n, gen)
        return images.double(), labels

    build = w.model
    w.model, w.make_batch = (lambda: build().double()), make_batch
    return w


# -- workloads that end their process, not just their step ---------------------------------


def _segfault() -> None:
    """A real segmentation fault (reads address 0): no Python exception, no result file."""
    import ctypes

    ctypes.string_at(0)


class _Segfaults(_Raises):
    def forward(self, x):
        self.calls += 1
        if self.calls > 2:
            _segfault()
        return self.fc(x)


def segfaults() -> Workload:
    """Builds fine, then dies of SIGSEGV in its third forward pass (inside training)."""
    w = tiny()
    w.model = _Segfaults
    return w


def _never_built():
    raise AssertionError("unreachable")


def segfaults_building() -> Workload:
    """Dies of SIGSEGV while its model is built (observation builds it first)."""
    w = tiny()

    def model():
        _segfault()
        return _never_built()

    w.model = model
    return w


def hangs_building() -> Workload:
    """Never finishes building its model."""
    w = tiny()

    def model():
        while True:
            time.sleep(1)

    w.model = model
    return w


def exits_building() -> Workload:
    """Ends its process with exit code 0 while its model is built: no exception, no result."""
    w = tiny()

    def model():
        import os

        os._exit(0)

    w.model = model
    return w


# -- workloads whose output misleads or floods -------------------------------------------


class _SaysOutOfMemory(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 2)

    def forward(self, x):
        print(
            "cache: evicting entries to stay clear of out of memory (OutOfMemoryError avoided)",
            flush=True,
        )
        return self.fc(x)


def says_out_of_memory() -> Workload:
    """Trains fine while every forward pass prints the words an out-of-memory error carries."""
    w = tiny()
    w.model = _SaysOutOfMemory
    return w


CHATTER_MIB_ENV = "TUNEKIT_TEST_CHATTER_MIB"


class _Chatty(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 2)
        self.said = False

    def forward(self, x):
        if not self.said:  # once per process: the first forward pass floods stdout
            import os
            import sys

            self.said = True
            line = "chatter " + "x" * 1015 + "\n"  # 1 KiB
            sys.stdout.write("chatty: first line\n")
            sys.stdout.write(line * (1024 * int(os.environ.get(CHATTER_MIB_ENV, "24"))))
            sys.stdout.write("chatty: last line\n")
            sys.stdout.flush()
        return self.fc(x)


def chatty() -> Workload:
    """Trains fine after printing $TUNEKIT_TEST_CHATTER_MIB MiB (default 24) in each process."""
    w = tiny()
    w.model = _Chatty
    return w


def forward_fails() -> Workload:
    """Builds fine; its forward pass fails on every batch (16 features into a layer that takes 15)."""
    w = tiny()
    w.model = lambda: nn.Sequential(nn.Linear(15, 4), nn.ReLU(), nn.Linear(4, 2))
    return w


def featured() -> Workload:
    """A small MLP with every training feature on: accumulation, a warm-up schedule,
    clipping (mixed precision is tested on its own: bf16 is not "the same mathematics")."""

    def make_batch(n, gen):
        x = torch.randn(n, 12, generator=gen)
        return x, x[:, :3].argmax(dim=1)

    return Workload(
        name="featured",
        model=lambda: nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3)),
        make_batch=make_batch,
        batch_size=4,
        lr=0.2,
        accumulation=3,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 3)
        ),
        clip_grad_norm=0.5,
    )
