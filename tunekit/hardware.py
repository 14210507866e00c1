"""The hardware model: compute devices, switches, host sockets and the links between them.

Plans can be made for machines one does not have: a :class:`Hardware` comes
either from a probe of this machine (``tunekit.observe.probe``) or from a TOML
profile. Profiles of the papers' machines ship in ``hardware_profiles/``.

Units inside tunekit are SI base units: bytes, seconds, bytes/s, FLOP/s.
TOML profiles use the units people quote (GB, GB/s, us, TFLOP/s) and say so in
each key's name; :func:`load_profile` converts.

TOML schema (every key required unless marked optional)::

    name = "dgx1-v100x4"
    description = "..."                 # optional
    [host]
    cores = 40
    memory_gb = 512
    sockets = ["cpu0", "cpu1"]          # optional; host vertices links may name
    [[devices]]                          # one table per kind of device
    name = "gpu"                         # with count > 1: gpu0, gpu1, ...
    count = 4                            # optional, default 1
    kind = "gpu"                         # "gpu" or "cpu" (a CPU rank or node)
    model = "Tesla V100-SXM2-16GB"
    memory_gb = 16
    peak_tflops = 15.7                   # FP32
    [[switches]]                         # optional
    name = "pcie0"
    [[links]]
    between = ["gpu0", "gpu1"]           # or  all_pairs = ["gpu0", ...]  or  star = ["sw", "gpu0", ...]
    bandwidth_gb_s = 25                  # per direction
    latency_us = 5
    kind = "nvlink"                      # optional label
    [[collectives]]                      # optional: a measured or calibrated fit
    backend = "nccl"; op = "all_reduce"; world_size = 4
    latency_us = 20; bandwidth_gb_s = 60; residual = 0.03
    latency_us_interval = [18, 23]       # optional: 95 % intervals of a measured fit
    bandwidth_gb_s_interval = [55, 63]   # optional
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import tomllib

from tunekit.errors import HardwareError

GB = 1e9
PROFILE_DIR = Path(__file__).parent / "hardware_profiles"


@dataclass(frozen=True)
class Device:
    """A device that runs one rank: a GPU, or a CPU rank or node."""

    name: str
    kind: str  # "gpu" | "cpu"
    model: str
    memory_bytes: float
    peak_flops: float  # FP32 FLOP/s


@dataclass(frozen=True)
class Link:
    """A bidirectional physical link; bandwidth is per direction."""

    a: str
    b: str
    bandwidth: float  # bytes/s
    latency: float  # s
    kind: str = ""

    def time(self, nbytes: float) -> float:
        """Store-and-forward time of ``nbytes`` over this one link."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Host:
    cores: int
    memory_bytes: float
    sockets: tuple[str, ...] = ()


@dataclass(frozen=True)
class CollectiveFit:
    """``time(bytes) = latency + bytes / bandwidth`` for one collective at one world size.

    A measured fit carries 95 % intervals of its latency and bandwidth
    (:func:`tunekit.observe.timing.fit_samples`); a fit from an older cache, a
    profile without them or a model has none (``None``), and its ends are its value.
    """

    backend: str  # "gloo" | "nccl" | "model"
    op: str  # "all_reduce" | "p2p" | "all_gather" | "h2d" | "d2h" | "memcpy"
    world_size: int
    latency: float  # s
    bandwidth: float  # bytes/s (effective, as fitted)
    residual: float = 0.0  # relative RMS error of the fit
    latency_interval: tuple[float, float] | None = None  # s, (low, high)
    bandwidth_interval: tuple[float, float] | None = None  # bytes/s, (low, high)

    def __post_init__(self) -> None:
        # JSON (the study store) gives lists back; keep the fit hashable and comparable.
        for name in ("latency_interval", "bandwidth_interval"):
            value = getattr(self, name)
            if value is not None:
                low, high = (float(v) for v in value)
                object.__setattr__(self, name, (low, high))

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    def bandwidth_bounds(self) -> tuple[float, float]:
        """(low, high) bandwidth: the interval, or the value twice when there is none."""
        return self.bandwidth_interval or (self.bandwidth, self.bandwidth)

    def latency_bounds(self) -> tuple[float, float]:
        return self.latency_interval or (self.latency, self.latency)

    def at_end(self, end: str) -> CollectiveFit:
        """This fit at the ``"slow"`` end of its intervals (high latency, low bandwidth) or ``"fast"``."""
        if end not in ("slow", "fast"):
            raise ValueError(f"end must be 'slow' or 'fast', not {end!r}")
        slow = end == "slow"
        lat_low, lat_high = self.latency_bounds()
        bw_low, bw_high = self.bandwidth_bounds()
        return replace(
            self,
            latency=lat_high if slow else lat_low,
            bandwidth=bw_low if slow else bw_high,
        )


@dataclass(frozen=True)
class Hardware:
    name: str
    devices: tuple[Device, ...]
    links: tuple[Link, ...] = ()
    switches: tuple[str, ...] = ()
    host: Host = field(default_factory=lambda: Host(cores=1, memory_bytes=0.0))
    collectives: tuple[CollectiveFit, ...] = ()
    description: str = ""
    source: str = ""  # "probe" or the profile's path

    # -- identity ---------------------------------------------------------------

    def fingerprint(self) -> str:
        """Stable id of the machine's shape (not of measured fits): keys the study store."""
        shape = {
            "devices": [(d.kind, d.model, round(d.memory_bytes / GB)) for d in self.devices],
            "links": sorted((lk.a, lk.b, lk.kind) for lk in self.links),
            "switches": sorted(self.switches),
            "host": (self.host.cores, round(self.host.memory_bytes / GB)),
        }
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_memory_cap(self, cap_bytes: float | None) -> Hardware:
        """This hardware with no device holding more than ``cap_bytes`` (``--memory-cap``):
        what planners read as each device's memory. None: unchanged."""
        if cap_bytes is None:
            return self
        return replace(
            self,
            devices=tuple(
                replace(d, memory_bytes=min(d.memory_bytes, float(cap_bytes)))
                if d.memory_bytes
                else replace(d, memory_bytes=float(cap_bytes))
                for d in self.devices
            ),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Hardware:
        return cls(
            name=data["name"],
            devices=tuple(Device(**d) for d in data["devices"]),
            links=tuple(Link(**lk) for lk in data.get("links", ())),
            switches=tuple(data.get("switches", ())),
            host=Host(**{**data["host"], "sockets": tuple(data["host"].get("sockets", ()))}),
            collectives=tuple(CollectiveFit(**c) for c in data.get("collectives", ())),
            description=data.get("description", ""),
            source=data.get("source", ""),
        )

    # -- queries ----------------------------------------------------------------

    @property
    def device_names(self) -> list[str]:
        return [d.name for d in self.devices]

    def device(self, name: str) -> Device:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(name)

    def vertices(self) -> list[str]:
        """Every vertex of the hardware graph: devices, switches, host sockets."""
        return self.device_names + list(self.switches) + list(self.host.sockets)

    def neighbours(self) -> dict[str, list[Link]]:
        adj: dict[str, list[Link]] = {v: [] for v in self.vertices()}
        for lk in self.links:
            adj[lk.a].append(lk)
            adj[lk.b].append(lk)
        return adj

    def route(self, src: str, dst: str, nbytes: float = 0.0) -> list[Link]:
        """The fastest store-and-forward path for ``nbytes`` (Dijkstra on link time)."""
        if src == dst:
            return []
        # arc i is links[i] one way or the other: both directions of every link in link
        # order, the order in which ties are broken
        links = [lk for lk in self.links for _ in (0, 1)]
        arcs = [
            (a, b, lk.latency, lk.bandwidth)
            for lk in self.links
            for a, b in ((lk.a, lk.b), (lk.b, lk.a))
        ]
        found = fastest_path(self.vertices(), arcs, src, dst, nbytes)
        if found is None:
            raise HardwareError(f"hardware {self.name!r}: no path from {src} to {dst}")
        return [links[i] for i in found[1]]

    def transfer_time(self, src: str, dst: str, nbytes: float) -> float:
        """Time to move ``nbytes`` from ``src`` to ``dst`` over the fastest path."""
        return sum(lk.time(nbytes) for lk in self.route(src, dst, nbytes))

    def path_bandwidth(self, src: str, dst: str) -> float:
        """Bottleneck bandwidth of the fastest path for large messages."""
        return min((lk.bandwidth for lk in self.route(src, dst, 1e9)), default=math.inf)

    def fit(self, op: str, world_size: int, backend: str | None = None) -> CollectiveFit | None:
        """The measured fit for ``op`` at ``world_size``, if the profile or probe has one."""
        for c in self.collectives:
            if c.op == op and c.world_size == world_size and backend in (None, c.backend):
                return c
        return None

    def allreduce_time(self, nbytes: float, world_size: int, backend: str | None = None) -> float:
        """Predicted all-reduce time of ``nbytes`` across ``world_size`` devices.

        Uses a measured fit when there is one; otherwise a ring all-reduce over
        the slowest device-to-device path: 2(p-1) steps of latency and
        2(p-1)/p of the bytes through the bottleneck.
        """
        if world_size <= 1:
            return 0.0
        fit = self.fit("all_reduce", world_size, backend)
        if fit is not None:
            return fit.time(nbytes)
        names = self.device_names[:world_size]
        if len(names) < world_size:
            raise HardwareError(
                f"hardware {self.name!r} has {len(self.devices)} devices, not {world_size}"
            )
        ring = list(zip(names, names[1:] + names[:1], strict=True))
        bw = min(self.path_bandwidth(a, b) for a, b in ring)
        lat = max(sum(lk.latency for lk in self.route(a, b)) for a, b in ring)
        p = world_size
        return 2 * (p - 1) * lat + 2 * (p - 1) / p * nbytes / bw

    def at_end(self, end: str) -> Hardware:
        """This machine with every fit at the ``"slow"`` or ``"fast"`` end of its 95 % intervals.

        Decisions that hinge on a measured figure evaluate both ends to see whether
        the measurement's uncertainty could change them. Fits without intervals
        and links (whose figures come from fits or profiles) are unchanged.
        """
        return replace(self, collectives=tuple(c.at_end(end) for c in self.collectives))

    def host_bandwidth(self, device: str) -> float:
        """Bandwidth between a device and its nearest host socket (D2H/H2D)."""
        fit = self.fit("d2h", 1)
        if fit is not None:
            return fit.bandwidth
        if not self.host.sockets:
            raise HardwareError(f"hardware {self.name!r} lists no host sockets")
        return max(self.path_bandwidth(device, s) for s in self.host.sockets)


# -- TOML profiles -----------------------------------------------------------------


def list_profiles() -> dict[str, Path]:
    """The shipped profiles, by name (file stem)."""
    return {p.stem: p for p in sorted(PROFILE_DIR.glob("*.toml"))}


def load_profile(name_or_path: str | Path) -> Hardware:
    """Load a shipped profile by name, or any TOML file by path, validating every field."""
    shipped = list_profiles()
    path = Path(name_or_path)
    if str(name_or_path) in shipped:
        path = shipped[str(name_or_path)]
    elif path.suffix != ".toml":
        raise HardwareError(
            f"unknown hardware profile {str(name_or_path)!r}; give a .toml file or one of: "
            f"{', '.join(shipped)}"
        )
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise HardwareError(f"hardware profile {path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HardwareError(f"cannot read hardware profile {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise HardwareError(f"{path}: not valid TOML ({exc})") from None
    hw = parse_profile(data, where=str(path))
    return hw


def parse_profile(data: dict[str, Any], where: str = "profile") -> Hardware:
    r = _Reader(where)
    name = r.text(data, "name")
    host_t = r.table(data, "host")
    host = Host(
        cores=int(r.num(host_t, "cores", "host.", minimum=1)),
        memory_bytes=r.num(host_t, "memory_gb", "host.") * GB,
        sockets=tuple(r.str_list(host_t, "sockets", "host.", required=False)),
    )
    devices: list[Device] = []
    dev_tables = data.get("devices")
    if not isinstance(dev_tables, list) or not dev_tables:
        raise HardwareError(f"{where}: needs at least one [[devices]] table")
    for i, t in enumerate(dev_tables):
        p = f"devices[{i}]."
        base = r.text(t, "name", p)
        count = int(r.num(t, "count", p, minimum=1, default=1))
        kind = r.text(t, "kind", p)
        if kind not in ("gpu", "cpu"):
            raise HardwareError(f"{where}: {p}kind must be 'gpu' or 'cpu', not {kind!r}")
        for j in range(count):
            devices.append(
                Device(
                    name=f"{base}{j}" if count > 1 else base,
                    kind=kind,
                    model=r.text(t, "model", p),
                    memory_bytes=r.num(t, "memory_gb", p) * GB,
                    peak_flops=r.num(t, "peak_tflops", p) * 1e12,
                )
            )
    switches = tuple(
        r.text(t, "name", f"switches[{i}].") for i, t in enumerate(data.get("switches", []))
    )
    known = {d.name for d in devices} | set(switches) | set(host.sockets)
    if len(known) != len(devices) + len(switches) + len(host.sockets):
        raise HardwareError(f"{where}: device, switch and socket names must be unique")
    links: list[Link] = []
    for i, t in enumerate(data.get("links", [])):
        p = f"links[{i}]."
        bw = r.num(t, "bandwidth_gb_s", p) * GB
        lat = r.num(t, "latency_us", p) * 1e-6
        kind = t.get("kind", "")
        pairs = _link_pairs(t, p, where)
        for a, b in pairs:
            for v in (a, b):
                if v not in known:
                    raise HardwareError(f"{where}: {p} names unknown vertex {v!r}")
            if bw <= 0:
                raise HardwareError(f"{where}: {p}bandwidth_gb_s must be positive")
            links.append(Link(a, b, bw, lat, kind))
    collectives = []
    for i, t in enumerate(data.get("collectives", [])):
        p = f"collectives[{i}]."
        collectives.append(
            CollectiveFit(
                backend=r.text(t, "backend", p),
                op=r.text(t, "op", p),
                world_size=int(r.num(t, "world_size", p, minimum=1)),
                latency=r.num(t, "latency_us", p) * 1e-6,
                bandwidth=r.num(t, "bandwidth_gb_s", p, minimum=1e-12) * GB,
                residual=r.num(t, "residual", p, default=0.0),
                latency_interval=r.interval(t, "latency_us_interval", p, 1e-6),
                bandwidth_interval=r.interval(t, "bandwidth_gb_s_interval", p, GB),
            )
        )
    return Hardware(
        name=name,
        devices=tuple(devices),
        links=tuple(links),
        switches=switches,
        host=host,
        collectives=tuple(collectives),
        description=str(data.get("description", "")),
        source=where,
    )


def fastest_path(
    vertices: Iterable[str],
    arcs: Sequence[tuple[str, str, float, float]],
    src: str,
    dst: str,
    nbytes: float,
    tolerance: float = 0.0,
) -> tuple[float, list[int]] | None:
    """Dijkstra on store-and-forward time: the fastest path of ``nbytes`` from ``src`` to
    ``dst`` over directed ``arcs`` ``(from, to, latency, bandwidth)``, a hop costing
    ``latency + nbytes / bandwidth``.

    Returns the delay and the indices of the path's arcs in order, or None when ``dst``
    cannot be reached. Ties go to the path found first (arcs are tried in the order
    given, vertices taken by time, then name); a later path replaces a vertex's best
    only when it is faster by more than ``tolerance`` seconds. :meth:`Hardware.route`
    routes with it, and so may a plugin's own graph of the machine (``tunekit.api``).
    """
    out: dict[str, list[int]] = {v: [] for v in vertices}
    for i, (a, _, _, _) in enumerate(arcs):
        out[a].append(i)
    best = {src: 0.0}
    prev: dict[str, int] = {}  # vertex -> the arc that reaches it on the best path
    heap = [(0.0, src)]
    while heap:
        t, v = heapq.heappop(heap)
        if v == dst:
            break
        if t > best.get(v, math.inf):
            continue
        for i in out[v]:
            _, w, latency, bandwidth = arcs[i]
            nt = t + (latency + nbytes / bandwidth)
            if nt < best.get(w, math.inf) - tolerance:
                best[w] = nt
                prev[w] = i
                heapq.heappush(heap, (nt, w))
    if dst not in best:
        return None
    path: list[int] = []
    v = dst
    while v != src:
        path.append(prev[v])
        v = arcs[prev[v]][0]
    return best[dst], path[::-1]


def _link_pairs(t: dict, p: str, where: str) -> list[tuple[str, str]]:
    given = [k for k in ("between", "all_pairs", "star") if k in t]
    if len(given) != 1:
        raise HardwareError(f"{where}: {p} needs exactly one of between, all_pairs, star")
    key = given[0]
    names = t[key]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise HardwareError(f"{where}: {p}{key} must be a list of names")
    if key == "between":
        if len(names) != 2:
            raise HardwareError(f"{where}: {p}between must name exactly two vertices")
        return [(names[0], names[1])]
    if key == "all_pairs":
        return [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    hub, *spokes = names
    return [(hub, s) for s in spokes]


class _Reader:
    """Reads typed fields and turns every mistake into one HardwareError line."""

    _missing = object()

    def __init__(self, where: str):
        self.where = where

    def table(self, data: dict, key: str) -> dict:
        t = data.get(key)
        if not isinstance(t, dict):
            raise HardwareError(f"{self.where}: missing [{key}] table")
        return t

    def text(self, data: dict, key: str, prefix: str = "") -> str:
        v = data.get(key)
        if not isinstance(v, str) or not v:
            raise HardwareError(f"{self.where}: missing or empty field {prefix}{key}")
        return v

    def str_list(self, data: dict, key: str, prefix: str = "", required: bool = True) -> list[str]:
        v = data.get(key, self._missing)
        if v is self._missing and not required:
            return []
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise HardwareError(f"{self.where}: field {prefix}{key} must be a list of names")
        return v

    def interval(
        self, data: dict, key: str, prefix: str, unit: float
    ) -> tuple[float, float] | None:
        """An optional ``[low, high]`` pair of non-negative numbers, scaled by ``unit``."""
        v = data.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or len(v) != 2:
            raise HardwareError(f"{self.where}: field {prefix}{key} must be [low, high]")
        low, high = (self.num({key: x}, key, prefix) for x in v)
        if low > high:
            raise HardwareError(f"{self.where}: field {prefix}{key} has low {low} > high {high}")
        return low * unit, high * unit

    def num(
        self, data: dict, key: str, prefix: str = "", minimum: float = 0.0, default=_missing
    ) -> float:
        v = data.get(key, self._missing)
        if v is self._missing:
            if default is not self._missing:
                return default
            raise HardwareError(f"{self.where}: missing field {prefix}{key}")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise HardwareError(f"{self.where}: field {prefix}{key} must be a number, not {v!r}")
        if v < minimum:
            raise HardwareError(f"{self.where}: field {prefix}{key} must be >= {minimum}, not {v}")
        return float(v)
