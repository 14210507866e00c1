"""A live run's directory: state, metrics, events, checkpoints, logs.

    .tunekit/runs/<id>/
        run.json         what to run: workload, ranks, config, steps (the supervisor's input)
        status.json      what runs now: status, step, config (rank 0 rewrites it every step)
        metrics.jsonl    one line per step: step, loss, step_s, samples_per_s, config_id
        events.jsonl     applies, watch verdicts, rollbacks, trials, relaunches
        checkpoints/     step-<N>.pt (rank 0's session; data-parallel replicas are identical)
        logs/            torchrun agent logs
        pids/            rank<R>: each rank's pid (telemetry samples them)
        control.sock     rank 0's control socket (mode 0600)
        token            the socket's shared secret (mode 0600)

Every file is written atomically (temporary file, then rename) or appended a
line at a time, so a crash leaves the directory consistent.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from tunekit.errors import ControlError

RUNS_DIR = "runs"
KEEP_CHECKPOINTS = 3
_SOCKET_MAX = 100  # sun_path is 108 bytes on Linux


def _atomic_write(path: Path, text: str, mode: int | None = None) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(text)
    if mode is not None:
        os.chmod(tmp, mode)
    tmp.replace(path)


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()

    # -- locations -------------------------------------------------------------------

    @property
    def run_file(self) -> Path:
        return self.path / "run.json"

    @property
    def status_file(self) -> Path:
        return self.path / "status.json"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def events_file(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def token_file(self) -> Path:
        return self.path / "token"

    @property
    def relaunch_file(self) -> Path:
        return self.path / "relaunch.json"

    @property
    def socket_path(self) -> Path:
        """``control.sock`` in the run directory, or a short private path when that is too long."""
        inside = self.path / "control.sock"
        if len(str(inside)) <= _SOCKET_MAX:
            return inside
        short = Path(f"/tmp/tunekit-{os.getuid()}")
        short.mkdir(mode=0o700, exist_ok=True)
        return short / f"{hashlib.sha256(str(self.path).encode()).hexdigest()[:16]}.sock"

    # -- creation and lookup -----------------------------------------------------------

    @classmethod
    def create(cls, store_dir: Path, spec: dict[str, Any], name: str | None = None) -> RunDir:
        run_id = name or time.strftime("%Y%m%d-%H%M%S") + f"-{secrets.token_hex(2)}"
        rd = cls(Path(store_dir) / RUNS_DIR / run_id)
        rd.path.mkdir(parents=True, exist_ok=False)
        rd.checkpoints.mkdir()
        rd.logs.mkdir()
        _atomic_write(rd.token_file, secrets.token_hex(32), mode=0o600)
        rd.write_run({**spec, "id": run_id, "created": time.time()})
        return rd

    @classmethod
    def find(cls, run: str | Path, store_dir: Path = Path(".tunekit")) -> RunDir:
        """A run by path, by id under ``store_dir/runs``, or ``latest``."""
        candidates = [Path(run), Path(store_dir) / RUNS_DIR / str(run)]
        if str(run) == "latest":
            runs = sorted((Path(store_dir) / RUNS_DIR).glob("*/run.json"), key=lambda p: p.stat().st_mtime)
            candidates = [runs[-1].parent] if runs else []
        for c in candidates:
            if (c / "run.json").is_file():
                return cls(c)
        raise ControlError(f"no run {str(run)!r} (give a run directory, a run id or 'latest')")

    @property
    def run_id(self) -> str:
        return self.path.name

    # -- state -------------------------------------------------------------------------

    def read_run(self) -> dict[str, Any]:
        return json.loads(self.run_file.read_text())

    def write_run(self, data: dict[str, Any]) -> None:
        _atomic_write(self.run_file, json.dumps(data, indent=2))

    def update_run(self, **fields: Any) -> dict[str, Any]:
        data = {**self.read_run(), **fields}
        self.write_run(data)
        return data

    def read_status(self) -> dict[str, Any]:
        try:
            return json.loads(self.status_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {"status": "starting"}

    def write_status(self, status: dict[str, Any]) -> None:
        _atomic_write(self.status_file, json.dumps({**status, "updated": time.time()}))

    def token(self) -> str:
        return self.token_file.read_text().strip()

    # -- streams -----------------------------------------------------------------------

    def append_metric(self, record: dict[str, Any]) -> None:
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps(record) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_file.exists():
            return []
        out = []
        for line in self.metrics_file.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a crash: everything before it stands
        return out

    def truncate_metrics(self, before_step: int) -> None:
        """Keep only steps below ``before_step`` (a resume replays the rest)."""
        kept = [m for m in self.read_metrics() if m["step"] < before_step]
        _atomic_write(self.metrics_file, "".join(json.dumps(m) + "\n" for m in kept))

    def log_event(self, kind: str, **payload: Any) -> dict[str, Any]:
        event = {"t": time.time(), "kind": kind, **payload}
        with open(self.events_file, "a") as f:
            f.write(json.dumps(event, default=str) + "\n")
        return event

    def read_events(self) -> list[dict[str, Any]]:
        if not self.events_file.exists():
            return []
        return [json.loads(line) for line in self.events_file.read_text().splitlines() if line.strip()]

    # -- checkpoints -------------------------------------------------------------------

    def save_checkpoint(self, step: int, state: dict[str, Any]) -> Path:
        path = self.checkpoints / f"step-{step:08d}.pt"
        tmp = path.with_suffix(".tmp")
        import torch  # here: the control commands read run folders without importing torch

        torch.save(state, tmp)
        tmp.replace(path)
        for old in sorted(self.checkpoints.glob("step-*.pt"))[:-KEEP_CHECKPOINTS]:
            if old != path:
                old.unlink(missing_ok=True)
        return path

    def latest_checkpoint(self) -> Path | None:
        found = sorted(self.checkpoints.glob("step-*.pt"))
        return found[-1] if found else None

    @staticmethod
    def load_checkpoint(path: Path) -> dict[str, Any]:
        import torch

        # Tensors, numbers and strings only: nothing is unpickled beyond that.
        return torch.load(path, map_location="cpu", weights_only=True)
