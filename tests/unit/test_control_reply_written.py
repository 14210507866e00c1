"""A request's reply reaches its client before the training loop moves on (tunekit.runtime.live
waits on ``Request.written``): a config that crashes the job at once must not take the reply
of the apply that brought it down with it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tunekit.runtime.control import ControlClient, ControlServer


def test_written_is_set_once_the_client_has_the_reply(tmp_path: Path):
    token = "0123456789abcdef" * 4
    server = ControlServer(tmp_path / "s.sock", token, status=dict, validate=lambda msg: None)
    got: dict = {}
    client = ControlClient(tmp_path / "s.sock", token, timeout_s=30)
    asking = threading.Thread(
        target=lambda: got.update(client.request("apply", config={"plugins": {}}))
    )
    asking.start()
    try:
        deadline = time.monotonic() + 30
        while (req := server.next_request()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert req is not None and req.op == "apply"
        assert not req.written.is_set()  # nothing answered yet
        req.answer({"ok": True, "step": 7})
        assert req.written.wait(30)
        asking.join(30)
        assert got == {"ok": True, "step": 7}
    finally:
        server.close(wait_s=1)
