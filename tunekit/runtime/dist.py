"""Process-group set-up inside a worker started by torchrun (or by tests)."""

from __future__ import annotations

import os
import random
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    group: dist.ProcessGroup | None


def pick_device(local_rank: int, prefer: str = "auto") -> torch.device:
    """``cuda:local_rank`` when a GPU is there and wanted, else the CPU."""
    if prefer not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {prefer!r}")
    if prefer != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if prefer == "cuda":
        raise RuntimeError("device 'cuda' requested but no CUDA device is available")
    return torch.device("cpu")


def init_from_env(prefer_device: str = "auto", timeout_s: float = 300.0) -> DistContext:
    """Join the process group torchrun describes in the environment (gloo on CPU, NCCL on GPU)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(local_rank, prefer_device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = None
    if world > 1:
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        group = dist.group.WORLD
    return DistContext(rank, world, local_rank, device, backend, group)


def ensure_group(ctx: DistContext) -> DistContext:
    """``ctx`` with a process group even on one rank (FSDP shards over a group, even of one):
    joined through the environment torchrun sets."""
    if ctx.group is not None:
        return ctx
    if not dist.is_initialized():
        dist.init_process_group(ctx.backend)
    return DistContext(
        ctx.rank, ctx.world_size, ctx.local_rank, ctx.device, ctx.backend, dist.group.WORLD
    )


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago, for a server started later.

    Chosen below the kernel's ephemeral range where that range can be read: the
    kernel hands ports in that range to every ``bind(0)`` and outgoing connection
    on the machine, any of which could take the port before its server binds it.
    """
    low = _ephemeral_low()
    if low is not None and low > 2048:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(max(1024, low - 12_000), low)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int | None:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def broadcast_object(obj, src: int = 0, group: dist.ProcessGroup | None = None):
    """Rank ``src``'s ``obj`` on every rank of ``group`` (identity without a process group).

    JSON, not pickle: ``src`` (a global rank) sends ``json.dumps(obj)`` as a length and
    then bytes in a uint8 tensor, so only plain data crosses between ranks and no rank
    ever unpickles what another sent. Every rank, ``src`` too, gets the JSON round
    trip (tuples come back as lists).
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    import json

    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":  # NCCL moves CUDA tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    data = json.dumps(obj).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if data:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    return json.loads(buf.cpu().numpy().tobytes())


def broadcast_bytes(
    data: bytes | None, src: int = 0, group: dist.ProcessGroup | None = None
) -> bytes | None:
    """Rank ``src``'s ``data`` on every rank of ``group`` over a CPU (gloo) group; ``None`` from
    ``src`` (it had nothing to send) is ``None`` everywhere, so no rank waits for bytes that never come."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return data
    mine = dist.get_rank() == src
    size = torch.tensor([-1 if not mine or data is None else len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    if n < 0:
        return None
    if mine:
        assert data is not None  # src sent -1 above for None
        if n:
            dist.broadcast(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), src=src, group=group
            )
        return bytes(data)
    buf = torch.empty(n, dtype=torch.uint8)
    if n:
        dist.broadcast(buf, src=src, group=group)
    return buf.numpy().tobytes()


@contextmanager
def single_rank_group() -> Iterator[None]:
    """A one-rank gloo process group for the duration, unless one already exists.

    Runtime hooks that install DDP or call collectives need a process group
    even on one rank; this gives them a real one without extra processes.
    """
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="tunekit-pg-") as tmp:
        store = dist.FileStore(str(Path(tmp) / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
