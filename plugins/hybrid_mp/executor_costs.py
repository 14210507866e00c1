"""What the executor's messages and its own work cost on this machine: the measured
point-to-point link between ranks (:class:`Link`), and the executor's costs beyond the
layers' own time, timed in this process (:class:`ExecutorOverheads`)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx

__all__ = ["ExecutorOverheads", "Link"]


@dataclass(frozen=True)
class Link:
    """One message between two ranks: ``latency + bytes / bandwidth`` (a measured fit)."""

    latency: float
    bandwidth: float
    source: str
    residual: float = 0.0
    """Relative RMS error of the fit over its sweep: how far one message may stray."""

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    def scaled(self, factor: float) -> Link:
        """The same link with its times multiplied by ``factor``."""
        return Link(self.latency * factor, self.bandwidth / factor, self.source, self.residual)

    @classmethod
    def measured(cls, hardware) -> Link | None:
        """The probe's point-to-point fit between two ranks, or None when none was measured."""
        fit = hardware.fit("p2p", 2)
        if fit is None or not fit.bandwidth > 0:
            return None
        return cls(
            fit.latency,
            fit.bandwidth,
            f"measured {fit.backend} send/recv: {fit.latency * 1e6:.0f} us + "
            f"{fit.bandwidth / 1e9:.2f} GB/s",
            fit.residual,
        )


@dataclass(frozen=True)
class ExecutorOverheads:
    """What the executor costs beyond the layers' own time, measured in this process.

    The executor runs every fx node through :class:`torch.fx.Interpreter` instead of
    the traced model's generated code, calls ``torch.autograd.backward`` once per
    backward segment where a plain step calls it once, and assembles the gradient of
    every value it received (a zero tensor plus each local consumer's gradient) before
    sending it back. Each is timed on the CPU of this process, the minimum over a few
    rounds: a busy machine only ever adds to it, and calibration adds the baseline's
    load to these costs as it does to the layers'.
    """

    node_s: float
    """Extra seconds per fx node the interpreter adds over generated code."""
    backward_call_s: float
    """Seconds of one ``torch.autograd.backward`` call on a tiny graph (the engine's start)."""
    assemble_s_per_byte: float
    """Seconds per byte of a received value to assemble its gradient (zeros, then a sum)."""
    copy_s_per_byte: float | None = None
    """CPU seconds per byte of one gloo message, sender's and receiver's copies together
    (a fresh receive buffer, as the executor's); None where gloo could not be timed."""
    source: str = "measured in this process"

    @classmethod
    def measure(cls, nodes: int = 64, repeats: int = 7) -> ExecutorOverheads:
        return cls(
            _interpreter_overhead(nodes, repeats),
            _backward_call(repeats),
            _assemble_per_byte(repeats),
            _gloo_copy_per_byte(max(2, repeats // 2)),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Chain(torch.nn.Module):
    """``nodes`` cheap additions: the interpreter's cost per node shows, not the op's."""

    def __init__(self, nodes: int):
        super().__init__()
        self.nodes = nodes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.nodes):
            x = x + 1.0
        return x


def _best_of(fn: Callable[[], Any], repeats: int, inner: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(inner):
            fn()
        best = min(best, (time.thread_time() - start) / inner)
    return best


def _interpreter_overhead(nodes: int, repeats: int) -> float:
    gm = torch.fx.symbolic_trace(_Chain(nodes))
    x = torch.zeros(1)
    graph_nodes = list(gm.graph.nodes)
    runner = torch.fx.Interpreter(gm, garbage_collect_values=False)

    def interpreted() -> None:
        env: dict[torch.fx.Node, Any] = {}
        runner.env = env
        for n in graph_nodes:
            if n.op == "placeholder":
                env[n] = x
            elif n.op != "output":
                env[n] = runner.run_node(n)

    with torch.no_grad():
        compiled = _best_of(lambda: gm(x), repeats, 20)
        walked = _best_of(interpreted, repeats, 20)
    return max(0.0, (walked - compiled) / nodes)


def _backward_call(repeats: int) -> float:
    leaf = torch.ones(1, requires_grad=True)
    grad = torch.ones(1)

    def forward_only() -> None:
        leaf * 2.0

    def forward_backward() -> None:
        torch.autograd.backward([leaf * 2.0], [grad])

    cost = _best_of(forward_backward, repeats, 50) - _best_of(forward_only, repeats, 50)
    leaf.grad = None
    return max(0.0, cost)


_ASSEMBLE_BYTES = 1 << 22  # 4 MiB: past the caches, as activations are


def _assemble_per_byte(repeats: int) -> float:
    value = torch.ones(_ASSEMBLE_BYTES // 4)
    grad = torch.ones_like(value)
    cost = _best_of(lambda: torch.zeros_like(value) + grad, repeats, 5)
    return cost / _ASSEMBLE_BYTES


_COPY_BYTES = 1 << 22


def _gloo_copy_per_byte(repeats: int, messages: int = 8) -> float | None:
    """CPU time per byte of a gloo send/recv between two process groups of this process.

    Two threads form a 2-rank gloo group over an in-memory store, so the message takes
    gloo's real path (its threads, the loopback socket) without starting processes;
    the process's CPU time counts both ends' copies.
    """
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        return None
    store = dist.HashStore()
    groups: list[Any] = [None, None]

    def join(rank: int) -> None:
        with contextlib.suppress(Exception):  # a rank that cannot join leaves None
            groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=20))

    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if any(g is None for g in groups):
        return None
    sender, receiver = groups
    src = torch.ones(_COPY_BYTES // 4)

    def message() -> None:
        dst = torch.empty_like(src)
        sent = sender.send([src], 1, 0)
        receiver.recv([dst], 0, 0).wait()
        sent.wait()

    message()  # connections, first buffers
    best = math.inf
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(messages):
            message()
        best = min(best, (time.process_time() - start) / messages)
    return best / _COPY_BYTES
