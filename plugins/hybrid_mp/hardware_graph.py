"""DLPlacer's hardware graph: compute nodes, routers and directed links.

Built from a :class:`~tunekit.hardware.Hardware` (a profile or a probe):
the devices of a model-parallel group with their memory Mem(n), every switch
and host socket as a router, and both directions of every physical link with
its bandwidth B(l) and latency L(l). Transfers are store-and-forward: a hop
costs D/B(l) + L(l), as in the paper's Eq. 11.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tunekit.api import Hardware, fastest_path
from tunekit.errors import HardwareError


@dataclass(frozen=True)
class Arc:
    """One direction of a physical link."""

    src: str
    dst: str
    bandwidth: float
    latency: float

    def time(self, nbytes: float) -> float:
        return nbytes / self.bandwidth + self.latency


@dataclass
class HardwareGraph:
    """DLPlacer's hardware graph: compute nodes N (with Mem(n)), routers R, directed arcs."""

    devices: list[str]
    memory: list[float]
    routers: list[str]
    arcs: list[Arc]
    _delays: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def vertices(self) -> list[str]:
        return self.devices + self.routers

    @classmethod
    def from_hardware(
        cls, hw: Hardware, devices: Sequence[str] | int | None = None
    ) -> HardwareGraph:
        """The graph of ``devices`` (names, or the first ``n``) with every switch and host socket.

        Devices not chosen are left out, so a route never passes through a
        GPU outside the model-parallel group.
        """
        if devices is None:
            names = hw.device_names
        elif isinstance(devices, int):
            if devices < 1 or devices > len(hw.devices):
                raise HardwareError(
                    f"hardware {hw.name!r} has {len(hw.devices)} devices; cannot place on {devices}"
                )
            names = hw.device_names[:devices]
        else:
            names = list(devices)
            for n in names:
                if n not in hw.device_names:
                    raise HardwareError(f"hardware {hw.name!r} has no device {n!r}")
        routers = list(hw.switches) + list(hw.host.sockets)
        keep = set(names) | set(routers)
        arcs: list[Arc] = []
        for lk in hw.links:
            if lk.a in keep and lk.b in keep:
                arcs.append(Arc(lk.a, lk.b, lk.bandwidth, lk.latency))
                arcs.append(Arc(lk.b, lk.a, lk.bandwidth, lk.latency))
        return cls(names, [hw.device(n).memory_bytes for n in names], routers, arcs)

    @classmethod
    def of(
        cls,
        devices: dict[str, float],
        links: Iterable[tuple[str, str, float, float]],
        routers: Sequence[str] = (),
    ) -> HardwareGraph:
        """A graph from ``{device: memory_bytes}`` and ``(a, b, bandwidth, latency)`` links."""
        names = list(devices) + list(routers)
        arcs: list[Arc] = []
        for a, b, bw, lat in links:
            if a not in names or b not in names:
                raise HardwareError(f"link {a}-{b} names an unknown vertex")
            if bw <= 0:
                raise HardwareError(f"link {a}-{b}: bandwidth must be positive")
            arcs += [Arc(a, b, bw, lat), Arc(b, a, bw, lat)]
        return cls(list(devices), [float(m) for m in devices.values()], list(routers), arcs)

    def shortest(self, src: str, dst: str, nbytes: float) -> tuple[float, list[str]]:
        """Store-and-forward delay of ``nbytes`` on the fastest path, and the path's vertices."""
        if src == dst:
            return 0.0, [src]
        arcs = [(a.src, a.dst, a.latency, a.bandwidth) for a in self.arcs]
        # The core's Dijkstra (Hardware.route's); a path must be faster by more than
        # 1e-18 s to replace one found first, so float noise never flips a tie.
        found = fastest_path(self.vertices, arcs, src, dst, nbytes, tolerance=1e-18)
        if found is None:
            raise HardwareError(f"no path from {src} to {dst} in the hardware graph")
        delay, path = found
        return delay, [src] + [self.arcs[i].dst for i in path]

    def delay(self, src: str, dst: str, nbytes: float) -> float:
        """Fastest store-and-forward time of ``nbytes`` from ``src`` to ``dst`` (cached)."""
        if src == dst:
            return 0.0
        key = (src, dst, float(nbytes))
        if key not in self._delays:
            self._delays[key] = self.shortest(src, dst, nbytes)[0]
        return self._delays[key]

    def fastest_arcs(self, nbytes: float) -> list[int]:
        """Indices of the arcs on the fastest path of ``nbytes`` between some pair of devices.

        Without link contention every transfer takes a fastest path, so a
        router or link on none of them never carries data of this size.
        """
        used: set[int] = set()
        for a in self.devices:
            for b in self.devices:
                if a == b:
                    continue
                path = self.shortest(a, b, nbytes)[1]
                for x, y in zip(path, path[1:], strict=False):
                    used.add(
                        min(
                            (i for i, arc in enumerate(self.arcs) if arc.src == x and arc.dst == y),
                            key=lambda i: self.arcs[i].time(nbytes),
                        )
                    )
        return sorted(used)

    def interchangeable_classes(
        self, sizes: Iterable[float], fixed: Iterable[str] = ()
    ) -> list[list[int]]:
        """Classes of device indices that any permutation may swap without changing the optimum.

        Two devices are swappable when their memory is equal and exchanging
        them leaves the fastest transfer time between every pair of devices
        unchanged for every message size in ``sizes``; transpositions generate
        the symmetric group, so each connected class may be freely permuted.
        Devices in ``fixed`` (hosting pinned ops) are never swapped.
        """
        n = len(self.devices)
        fixed_idx = {self.devices.index(d) for d in fixed}
        sizes = sorted(set(float(s) for s in sizes)) or [0.0]
        table = {
            (i, j, s): self.delay(self.devices[i], self.devices[j], s)
            for i in range(n)
            for j in range(n)
            if i != j
            for s in sizes
        }

        def swappable(a: int, b: int) -> bool:
            if a in fixed_idx or b in fixed_idx:
                return False
            if not math.isclose(self.memory[a], self.memory[b], rel_tol=1e-9):
                return False
            perm = list(range(n))
            perm[a], perm[b] = b, a
            return all(
                math.isclose(table[(perm[i], perm[j], s)], t, rel_tol=1e-9, abs_tol=1e-15)
                for (i, j, s), t in table.items()
            )

        parent = list(range(n))

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for a in range(n):
            for b in range(a + 1, n):
                if find(a) != find(b) and swappable(a, b):
                    parent[find(b)] = find(a)
        classes: dict[int, list[int]] = {}
        for i in range(n):
            classes.setdefault(find(i), []).append(i)
        return [c for c in classes.values() if len(c) > 1]
