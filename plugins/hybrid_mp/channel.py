"""Point-to-point transfers between the ranks of a model-parallel worker: values
forward, their gradients backward, received in the order their peer sent them."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from tunekit.api import CommRecord
from tunekit.errors import PluginError

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip
_HEADER_LEN = 10  # dtype code, ndim, up to 8 dims


class Channel:
    """Point-to-point transfers, received in the order they were sent.

    Shapes travel in a small header the first time a value crosses for a
    given input signature. No tags: NCCL has none and matches sends to
    receives in order, so :meth:`take` receives from a peer strictly in the
    peer's send order (which both ends compute from the segment list),
    holding early arrivals until they are needed; gloo runs the same way.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.shapes: dict[tuple, tuple[torch.Size, torch.dtype]] = {}
        self.records: list[CommRecord] = []
        self.inbox: dict[tuple, dict[str, torch.Tensor]] = {}
        self.cursor: dict[tuple, int] = {}

    def start_step(self) -> None:
        self.inbox.clear()
        self.cursor.clear()

    def take(
        self,
        key: tuple,
        order: Sequence[str],
        value: str,
        src: int,
        signature: tuple,
        wanted=lambda _v: True,
    ) -> torch.Tensor:
        """``value`` from rank ``src``, which sends the values of ``order`` in that order
        (those ``wanted`` says it skips are never sent)."""
        box = self.inbox.setdefault(key, {})
        pos = self.cursor.get(key, 0)
        while value not in box:
            if pos >= len(order):
                raise PluginError(f"hybrid_mp: {value} never arrives from rank {src}")
            nxt, pos = order[pos], pos + 1
            if wanted(nxt):
                box[nxt] = self.recv(src, f"{key[0]} {nxt}", signature)
        self.cursor[key] = pos
        return box.pop(value)

    def send(self, t: torch.Tensor, dst: int, name: str, signature: tuple) -> None:
        if not isinstance(t, torch.Tensor):
            raise PluginError(
                f"hybrid_mp: value {name} ({type(t).__name__}) must cross devices but is not a tensor; "
                "place its producer and consumers together"
            )
        t = t.detach().contiguous()
        key = (signature, name, dst)
        if key not in self.shapes:
            if t.dim() > _HEADER_LEN - 2 or t.dtype not in _DTYPES:
                raise PluginError(f"hybrid_mp: cannot send {name} ({t.dtype}, {t.dim()} dims)")
            header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
            header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
            header[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
            header = header.to(self.device)
            self.pending.append((dist.isend(header, dst), header))
            self.shapes[key] = (t.shape, t.dtype)
        self.pending.append((dist.isend(t, dst), t))

    def recv(self, src: int, name: str, signature: tuple) -> torch.Tensor:
        key = (signature, name, src)
        start = time.perf_counter()
        if key not in self.shapes:
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            dist.recv(header, src)
            h = header.cpu().tolist()
            self.shapes[key] = (torch.Size(h[2 : 2 + h[1]]), _DTYPES[h[0]])
        shape, dtype = self.shapes[key]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src)
        waited = time.perf_counter() - start
        self.records.append(
            CommRecord(f"recv {name}", buf.numel() * buf.element_size(), waited, waited)
        )
        return buf

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
