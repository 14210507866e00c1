"""How fast the TUI switches screens, and how much memory the idle app holds.

    .venv/bin/python benchmarks/tui_responsiveness.py [--rounds 5] [--sizes 80x24,120x40,200x60]

SCREEN SWITCHES. The app runs headless (Textual's ``run_test``) over the fixed data of
the TUI's tests (``tests/tui/conftest.py``: the core's own formats, two GPUs' NVML
series, a profiled run, a whole tuning), with every screen's state filled: a
diagnosis, a finished tuning, a profiled run. Then, ``--rounds`` times, each screen
in turn (2 3 4 5 ? 1). Per screen and size, the first visit (the screen is composed)
and the median of the later ones: the milliseconds from the key to the new screen's
first frame and to its last frame before the app went idle (what a person waits
for: the frames the app hands its terminal, timed at Textual's ``App._display``),
and to the pilot finding the app idle, in wall and CPU milliseconds of this process
(the pilot waits for quiet windows of its own after the last frame). The target:
every switch painted under 200 ms on an idle machine.

IDLE MEMORY. The app attached to a run directory as ``tunekit run`` writes it, in a
process of its own, until it has listed the plugins and polled the job, then the
process's peak RSS (Linux: ``VmHWM``) and whether torch was imported; interleaved, the same with the
plugins imported in the app's process (as the app did before issue 35: ``load_all``,
which imports torch). The ratio is the memory the idle app saves.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("2", "3", "4", "5", "question_mark", "1")
NAMES = {
    "1": "live",
    "2": "profile",
    "3": "tuners",
    "4": "trials",
    "5": "apply",
    "question_mark": "help",
}


def fixed_data():
    """tests/tui/conftest.py, the fixed backend and its helpers (loaded by path: not a package)."""
    spec = importlib.util.spec_from_file_location("tui_fixed", ROOT / "tests/tui/conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def switches(size: tuple[int, int], rounds: int) -> dict[str, list[tuple[float, float]]]:
    """(wall ms, CPU ms) of each switch to each screen, first visit first."""
    fixed = fixed_data()
    app = fixed.make_app()
    until = fixed.until
    out: dict[str, list[tuple[float, float]]] = {}
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: app.live_view.step == 60 and app.tuner_views, 60)
        for key in ("d", "t", "p"):  # every screen's state: before the screens are visited
            getattr(app, {"d": "action_diagnose", "t": "action_tune", "p": "action_profile"}[key])()
        await until(
            pilot,
            lambda: (
                app.study_view.state == "finished"
                and app.profile_view is not None
                and not app.profile_stage
                and all(t.state not in ("waiting", "diagnosing") for t in app.tuner_views)
            ),
            120,
        )
        await pilot.pause(0.5)
        painted = paints(app)
        for _ in range(rounds):
            for key in KEYS:
                wall, cpu = time.perf_counter(), time.process_time()
                painted.clear()
                await pilot.press(key)
                await pilot.pause()
                idle = ((time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3)
                drawn = [t for screen, t in painted if screen is app.screen]
                if not drawn:
                    raise SystemExit(f"{NAMES[key]}: the new screen was never painted")
                out.setdefault(NAMES[key], []).append(
                    (*idle, (drawn[0] - wall) * 1e3, (drawn[-1] - wall) * 1e3)
                )
    return out


def paints(app) -> list[tuple[object, float]]:
    """(screen, time) of each frame the app hands to its terminal from now on: Textual's
    ``App._display``, which a headless app runs too (it only skips the terminal write)."""
    painted: list[tuple[object, float]] = []
    display = app._display

    def timed(screen, renderable):
        if renderable is not None and not app._batch_count:  # what _display would write
            painted.append((screen, time.perf_counter()))
        return display(screen, renderable)

    app._display = timed
    return painted


IDLE_APP = """
import asyncio, json, sys
in_process = sys.argv[3] == "in-process"
if in_process:  # what the app did before: the plugins imported here
    from tunekit.plugin_loading import load_all
from tunekit.tui.app import TunekitApp
from tunekit.tui.backend import TuneRequest, attach

async def main(run, store):
    backend = attach(run, store)
    if in_process:
        backend.plugins = load_all
    app = TunekitApp(backend, TuneRequest(), poll_s=0.2)
    try:
        async with app.run_test(size=(120, 36)) as pilot:
            while not (app.live_view.step and app.tuner_views):
                await pilot.pause(0.1)
            await pilot.pause(1.0)
    finally:
        backend.close(stop_job=False)
    # VmHWM: this process's peak RSS (getrusage's would count the parent's too: it survives
    # exec on Linux).
    status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
    print(json.dumps({"rss_mib": int(status["VmHWM"].split()[0]) / 1024,
                      "torch": "torch" in sys.modules}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def run_dir(tmp: Path) -> tuple[Path, Path]:
    """A run directory with the files a live job writes (no job: the app only reads them)."""
    from tunekit.runtime.rundir import RunDir

    fixed = fixed_data()
    store = tmp / ".tunekit"
    rd = RunDir.create(
        store, {"workload": "example:cnn", "nproc": 2, "config": fixed.BASE}, name="job"
    )
    rd.write_status(fixed.status(40))
    rd.metrics_file.write_text("".join(json.dumps(m) + "\n" for m in fixed.metrics(40)))
    return rd.path, store


def idle_memory(rounds: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"now": [], "in-process": []}
    with tempfile.TemporaryDirectory() as tmp:
        path, store = run_dir(Path(tmp))
        for _ in range(rounds):
            for mode in out:  # interleaved: both see the same machine
                done = subprocess.run(
                    [sys.executable, "-c", IDLE_APP, str(path), str(store), mode],
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=True,
                )
                out[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="80x24,120x40,200x60")
    parser.add_argument("--memory-rounds", type=int, default=2)
    args = parser.parse_args()
    print("screen switches, ms from the key: to the new screen's first frame and its last one")
    print("before the app was idle (painted), and to the pilot finding the app idle (wall / CPU)")
    print(
        f"{'size':>8} {'screen':>8} {'first visit: painted':>21} {'idle':>15} "
        f"{'later, median: painted':>23} {'idle':>15} {'later, max painted':>19}"
    )
    worst = worst_first = 0.0
    for size in args.sizes.split(","):
        w, h = (int(v) for v in size.split("x"))
        for screen, times in asyncio.run(switches((w, h), args.rounds)).items():
            first, later = times[0], times[1:]
            med = [statistics.median(t[i] for t in later) for i in range(4)]
            worst = max(worst, med[3])
            worst_first = max(worst_first, first[3])
            print(
                f"{size:>8} {screen:>8} {first[2]:9.0f} – {first[3]:4.0f}  "
                f"{first[0]:6.0f} / {first[1]:5.0f} {med[2]:11.0f} – {med[3]:4.0f}  "
                f"{med[0]:6.0f} / {med[1]:5.0f} {max(t[3] for t in later):19.0f}"
            )
    print(
        f"slowest switch, key to the last frame: first visit {worst_first:.0f} ms, "
        f"later visits (median) {worst:.0f} ms (target < 200 ms idle)"
    )
    print()
    print("idle app (attached, plugins listed, job polled): peak RSS")
    mem = idle_memory(args.memory_rounds)
    for mode, runs in mem.items():
        rss = statistics.median(r["rss_mib"] for r in runs)
        torch = {r["torch"] for r in runs}
        what = "plugins listed in a child" if mode == "now" else "plugins imported in the app"
        print(f"  {what:28} {rss:7.0f} MiB  torch imported: {sorted(torch)}")
    ratio = statistics.median(r["rss_mib"] for r in mem["in-process"]) / statistics.median(
        r["rss_mib"] for r in mem["now"]
    )
    print(f"  ratio (in the app / in a child): {ratio:.1f}x")


if __name__ == "__main__":
    main()
