"""Memory a rank holds, measured: now, and at its peak within a window (a step, a probe).

* **CUDA**: the caching allocator's own counters (``memory_allocated``,
  ``max_memory_allocated``), free to read.
* **CPU**: torch has no allocator statistic, but its memory profiler reports every
  allocation and free the CPU allocator makes (with its address) while it runs. The
  tracker keeps ``torch.profiler``'s Kineto backend on in short windows laid end to end,
  recording allocations only (no operator events), and keeps a table of the blocks it saw
  allocated and not yet freed: their sum is the bytes allocated since it started and still
  alive. Collectives on gloo free some buffers in gloo's own threads, where the profiler
  does not look (FSDP's gathered parameters, DDP's start-up broadcast): such a block is
  dropped from the table when its address is handed out again. The allocator reuses the
  addresses of a step's buffers in the next step (measured: FSDP's per-step peaks on 2 gloo
  ranks stay within one block's gathered size), but it owes us nothing: a large block
  freed elsewhere is seldom handed out again (glibc serves the next one from another
  place), so a sharded session restarts the total at every step boundary from a count of
  what it holds (parameter shards, buffers, optimizer state, gradients, tensors kept on the
  session, the gradient strategy's buffers), which is exact there (FSDP has resharded every
  block; checked on its parameter groups). What a runtime hook of such a job holds
  elsewhere (in a closure) is not counted. A replicated session is not restarted (every
  allocation a hook made stays counted); DDP's start-up broadcast, which packs every
  parameter into one buffer gloo frees in its thread, is done in place instead
  (``tunekit.runtime.sync.sync_replicas``). Within a step a measured peak is an upper bound
  by what gloo freed unseen since the step began (at most a block's gathered parameters or
  two, measured). Frees of tensors that existed before the tracker started are not
  subtracted (it never counted them).

Cost, measured on the 2-core development machine with the steps interleaved: about 4 ms per
step on a toy transformer (a thousand small allocations), nothing measurable on a 90 ms CNN
step. The trial runtime tracks the warm-up steps (where a configuration's peak shows: a step
at a fixed configuration and input shape allocates the same every time) and every step only
when a ``--memory-cap`` is set (see docs/architecture.md, "Memory").

:class:`PeakMeter` is the nestable view plugins use: inside a session that tracks, it reads
the session's tracker; elsewhere it runs a tracker of its own.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tunekit.memory import format_bytes

_LOCAL = threading.local()


def active_tracker() -> AllocationTracker | None:
    """The tracker running in this thread, if any."""
    return getattr(_LOCAL, "tracker", None)


@atexit.register
def _stop_at_exit() -> None:
    """A session never closed leaves its tracker on; the profiler must not outlive Python's
    own teardown (Kineto crashes the exiting process when it does)."""
    tracker = active_tracker()
    if tracker is not None:
        tracker.stop()


@dataclass
class Window:
    """Peak of the tracked bytes between :meth:`AllocationTracker.open` and :meth:`close`."""

    tracker: AllocationTracker
    start_bytes: int
    peak_bytes: int
    closed: bool = False

    @property
    def peak_above_start(self) -> int:
        return self.peak_bytes - self.start_bytes

    def close(self) -> int:
        """Stop following; the absolute peak in bytes."""
        if not self.closed:
            self.tracker._drain()
            self.tracker._windows[:] = [w for w in self.tracker._windows if w is not self]
            self.closed = True
        return self.peak_bytes


class AllocationTracker:
    """Bytes allocated on one device since :meth:`start` and still alive, with windowed peaks."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.method = "cuda-allocator" if self.device.type == "cuda" else "cpu-profiler"
        self.running = 0
        """Bytes allocated since start and alive at the last drain (CUDA: allocated now)."""
        self._windows: list[Window] = []
        self._on = False
        self._blocks: dict[int, int] = {}
        """CPU: address -> size of every block seen allocated and not yet freed."""
        self._marks: dict[int, str] = {}
        """CPU: marker size -> label of the segment it starts (see :meth:`mark`)."""
        self._segment: tuple[str, Window] | None = None
        self.segments: dict[str, int] = {}
        """Per label given to :meth:`mark`: the peak of the segment it began (absolute bytes)."""

    # -- life -----------------------------------------------------------------------------

    def start(self) -> AllocationTracker:
        """Start following. One tracker runs per thread: a session left without ``close()``
        (a test's, a notebook's) would otherwise keep the profiler to itself, so the newest
        tracker stops the one before it."""
        if self._on:
            return self
        previous = active_tracker()
        if previous is not None:
            previous.stop()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.running = int(torch.cuda.memory_allocated(self.device))
        else:
            _profiler_on()
        self._on = True
        _LOCAL.tracker = self
        return self

    def stop(self) -> None:
        if not self._on:
            return
        self._drain(restart=False)
        self._on = False
        if active_tracker() is self:
            _LOCAL.tracker = None

    @property
    def running_now(self) -> bool:
        return self._on

    def __enter__(self) -> AllocationTracker:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- reading ---------------------------------------------------------------------------

    def current(self) -> int:
        """Bytes allocated now (since start, for the CPU)."""
        self._drain()
        return self.running

    def rebase(self, resident_bytes: int) -> None:
        """Set the total to ``resident_bytes``, counted by the caller at a step boundary:
        blocks freed unseen by another thread stop counting from here on."""
        self._drain()
        self.running = int(resident_bytes)

    def mark(self, label: str) -> None:
        """End the current segment and begin one called ``label``, without stopping the
        profiler: usable inside an operation or an autograd hook, where a drain would cut
        the profiler's records of the operation in two. CPU: a tiny marker tensor of a size
        no model allocates (odd, above 64 KiB) is allocated and freed at once; the drain
        that meets it in the stream ends the segment there. CUDA: a drain at once."""
        if self.device.type == "cuda":
            self._on_mark(label, None)
            return
        size = _MARKER_BYTES + 2 * len(self._marks) + 1
        self._marks[size] = label
        torch.empty(size, dtype=torch.uint8)

    def end_segments(self) -> dict[str, int]:
        """Close the last segment; the peaks of all of them (then forgotten)."""
        self.mark("")
        self._drain()
        self._close_segment()
        out, self.segments, self._marks = dict(self.segments), {}, {}
        self.segments.pop("", None)
        out.pop("", None)
        return out

    def _on_mark(self, label: str, running: int | None) -> None:
        if running is None:
            self._drain()
            running = self.running
        self._close_segment()
        window = Window(self, running, running)
        self._windows.append(window)
        self._segment = (label, window)

    def _close_segment(self) -> None:
        if self._segment is not None:
            label, window = self._segment
            self._windows[:] = [w for w in self._windows if w is not window]
            self.segments[label] = max(self.segments.get(label, 0), window.peak_bytes)
            self._segment = None

    def open(self) -> Window:
        """Follow the peak from now on (until :meth:`Window.close`)."""
        self._drain()
        window = Window(self, self.running, self.running)
        self._windows.append(window)
        return window

    def _drain(self, restart: bool = True) -> None:
        if not self._on:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = int(torch.cuda.max_memory_allocated(self.device))
            self.running = int(torch.cuda.memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            for w in self._windows:
                w.peak_bytes = max(w.peak_bytes, peak)
            return
        events = _profiler_off()
        if restart:
            _profiler_on()
        self.running = account(
            self._blocks, self.running, events, self._windows, self._marks, self._on_mark
        )


_MARKER_BYTES = 65_536 + 4_093
"""Marker tensors (:meth:`AllocationTracker.mark`) are this many bytes plus an odd number."""


def account(
    blocks: dict[int, int],
    running: int,
    events: list[tuple[int, int]],
    windows: list[Window],
    marks: dict[int, str] | None = None,
    on_mark: Callable[[str, int], None] | None = None,
) -> int:
    """Apply ``(address, +size | -size)`` events to the table of live ``blocks``; return the
    new total and raise each window's peak. An address allocated again while the table holds
    it was freed where the profiler did not look (another thread): the old block goes. A
    marker's allocation (its size in ``marks``) is not counted: it calls ``on_mark``."""
    marker_at: set[int] = set()
    for ptr, nbytes in events:
        if marks and nbytes in marks and on_mark is not None:
            marker_at.add(ptr)
            on_mark(marks.pop(nbytes), running)
            continue
        if nbytes < 0 and ptr in marker_at:
            marker_at.discard(ptr)
            continue
        if nbytes > 0:
            running += nbytes - blocks.get(ptr, 0)
            blocks[ptr] = nbytes
            for w in windows:
                if running > w.peak_bytes:
                    w.peak_bytes = running
        else:
            running -= blocks.pop(ptr, 0)
    return running


def _profiler_on() -> None:
    """Kineto, CPU, allocations only: no operator events (user scopes only), no shapes."""
    from torch._C._profiler import (
        ProfilerActivity,
        ProfilerConfig,
        ProfilerState,
        RecordScope,
        _ExperimentalConfig,
    )

    config = ProfilerConfig(
        ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig(), ""
    )
    activities = {ProfilerActivity.CPU}
    torch.autograd._prepare_profiler(config, activities)
    torch.autograd._enable_profiler(config, activities, {RecordScope.USER_SCOPE})


def _profiler_off() -> list[tuple[int, int]]:
    """Stop the profiler; ``(address, bytes)`` of each CPU allocation (+) and free (-), in order."""
    result = torch.autograd._disable_profiler()
    found: list[tuple[int, int, int]] = []
    stack = list(result.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            found.append((event.start_time_ns, fields.ptr, fields.alloc_size))
    found.sort()
    return [(ptr, n) for _, ptr, n in found]


class PeakMeter:
    """Context manager: the peak of the bytes allocated inside the block, absolute and above
    its start. Nested inside a tracker (a session that measures its steps) it reads that
    tracker; elsewhere it runs its own. ``peak_bytes`` (above the start) is None when no
    measurement was possible (another, non-tunekit profiler runs in this thread)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.peak_bytes: float | None = None
        """Peak above what was allocated when the block began."""
        self.start_bytes = 0.0
        """Bytes allocated when the block began (tracked since the outer tracker started;
        0 for a meter of its own on the CPU, which cannot see earlier allocations)."""
        self.method = ""
        self._own: AllocationTracker | None = None
        self._window: Window | None = None

    def __enter__(self) -> PeakMeter:
        tracker = active_tracker()
        if tracker is None or tracker.device != self.device:
            try:
                tracker = self._own = AllocationTracker(self.device).start()
            except RuntimeError:  # a profiler is already running in this thread
                return self
        self.method = tracker.method
        self._window = tracker.open()
        self.start_bytes = float(self._window.start_bytes)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._window is None:
            return
        self._window.close()
        if exc_type is None:
            self.peak_bytes = float(self._window.peak_above_start)
        if self._own is not None:
            self._own.stop()
            self._own = None


class MemoryCapExceeded(torch.OutOfMemoryError):
    """A step's measured peak went over ``--memory-cap``: out of memory, as a device would be."""


class StepPeaks:
    """A session's per-step peak memory, checked against a cap (``--memory-cap``)."""

    def __init__(
        self,
        device: torch.device,
        cap_bytes: int | None = None,
        resident: Callable[[], int | None] | None = None,
    ):
        self.tracker: AllocationTracker | None = AllocationTracker(device)
        self.cap_bytes = cap_bytes
        self.resident = resident
        """Counts what the session holds between steps (None: it cannot). Gloo frees some
        buffers in its own threads (FSDP's gathered parameters, DDP's start-up broadcast);
        when their addresses are not handed out again (large blocks seldom are), the total
        would keep them: each step is measured from this count instead (CPU)."""
        self._method = ""
        self.last: int | None = None
        """Peak of the last measured step, in bytes (absolute: what the rank held)."""
        self.max: int | None = None
        """Largest peak of any measured step."""

    @property
    def method(self) -> str:
        """How the peaks were measured (empty when nothing was)."""
        return self._method

    @property
    def measuring(self) -> bool:
        return self.tracker is not None and self.tracker.running_now

    def start(self) -> None:
        """Start before the model is built, so that the model counts (CPU)."""
        if self.tracker is None:
            return
        try:
            self.tracker.start()
            self._method = self.tracker.method
        except RuntimeError:  # another profiler runs in this thread: no measurement
            self.tracker = None

    def stop(self) -> None:
        """Stop measuring for good (a CPU total cannot resume: what changed unseen is lost)."""
        if self.tracker is not None:
            self.tracker.stop()
            self.tracker = None

    def open(self) -> Window | None:
        if not self.measuring or self.tracker is None:
            return None
        if self.resident is not None and self.tracker.device.type == "cpu":
            held = self.resident()
            if held is not None:
                self.tracker.rebase(held)
        return self.tracker.open()

    def close(self, window: Window | None, step: int) -> int | None:
        """The step's peak; raises :class:`MemoryCapExceeded` when it is over the cap."""
        if window is None:
            return None
        peak = window.close()
        self.last = peak
        self.max = peak if self.max is None else max(self.max, peak)
        if self.cap_bytes is not None and peak > self.cap_bytes:
            raise MemoryCapExceeded(
                f"step {step} peaked at {format_bytes(peak)} on this rank, over the memory cap "
                f"of {format_bytes(self.cap_bytes)} (--memory-cap): out of memory"
            )
        return peak
