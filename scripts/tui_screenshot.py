"""Regenerate docs/images/tui.svg: the app on a live job, after a real tuning.

    python scripts/tui_screenshot.py [--size 140x42] [--out docs/images/tui.svg]

Starts `example:cnn` on 2 ranks as `tunekit tui` does, tunes it with
overlap_chunking (2 candidates, 10 steps each) from the tuners screen, and saves
the trials screen once the study has finished. Takes minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from tunekit.runtime.job_process import JobProcess
from tunekit.tui.app import TunekitApp
from tunekit.tui.backend import LiveBackend, TuneRequest
from tunekit.tui.screens.trials import TrialsScreen
from tunekit.tui.screens.tuners import TunersScreen


async def until(pilot, condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit("the app did not get there in time")
        await pilot.pause(0.5)


async def shoot(size: tuple[int, int], out: Path) -> None:
    store = Path(tempfile.mkdtemp(prefix="tunekit-shot-")) / ".tunekit"
    job = JobProcess.start("example:cnn", nproc=2, store_dir=store)
    backend = LiveBackend(job.rd, store, job=job)
    request = TuneRequest(plugins=["overlap_chunking"], trials=2, steps=10, warmup=2)
    try:
        app = TunekitApp(backend, request, poll_s=1.0)
        async with app.run_test(size=size) as pilot:
            await until(
                pilot, lambda: app.live_view.status == "running" and app.live_view.step >= 20, 600
            )
            await pilot.press("3")
            await until(
                pilot, lambda: isinstance(app.screen, TunersScreen) and app.tuner_views, 120
            )
            await pilot.press("t")
            await until(pilot, lambda: app.study_view.state not in ("idle", "running"), 1800)
            await pilot.press("4")
            await until(pilot, lambda: isinstance(app.screen, TrialsScreen), 30)
            await pilot.pause(3.0)
            app.clear_notifications()
            await pilot.pause(0.5)
            app.save_screenshot(out.name, str(out.parent))
    finally:
        backend.close(stop_job=True)
    print(f"saved {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="140x42", help="terminal columns x lines")
    parser.add_argument("--out", type=Path, default=Path("docs/images/tui.svg"))
    args = parser.parse_args()
    columns, lines = (int(v) for v in args.size.split("x"))
    asyncio.run(shoot((columns, lines), args.out))


if __name__ == "__main__":
    main()
