"""Live: the job as it trains — step time, throughput, loss, per-device and per-rank telemetry, its config."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import ScrollableContainer, Vertical
from textual.widget import Widget
from textual.widgets import Label, Static

from tunekit.tui.formatting import ms, number, pct, per_sample_rate, rate, size
from tunekit.tui.screens.apply import rolled_back_on_request, watch_verdict
from tunekit.tui.screens.base import TunekitScreen
from tunekit.tui.state import DeviceView, LiveView
from tunekit.tui.widgets import ConfigPanel, MetricRow
from tunekit.tui.widgets.chart import Series

STATUS_STYLE = {
    "running": "bold green",
    "starting": "bold yellow",
    "relaunching": "bold yellow",
    "paused": "bold yellow",
    "finished": "bold cyan",
    "stopped": "bold cyan",
    "crashed": "bold red",
    "exited": "bold red",
}


def _last(values: Sequence[float]) -> float | None:
    return values[-1] if values else None


def job_line(view: LiveView) -> Text:
    """One line: status, step, ranks, loss, step time, throughput, config."""
    text = Text("● ", style=STATUS_STYLE.get(view.status, "bold"))
    text.append(view.status, style=STATUS_STYLE.get(view.status, "bold"))
    total = f"/{view.total_steps}" if view.total_steps else ""
    text.append(
        f"  step {view.step}{total} · {view.world_size or '?'} rank(s) · loss {number(view.loss, 4)}"
        f" · {ms(view.step_s)}/step · {number(view.samples_per_s)} samples/s"
    )
    if view.attached:
        text.append("  attached: the job keeps running when you quit", style="dim")
    else:
        text.append("  q stops the job; a closed terminal leaves it running", style="dim")
    if view.error:
        text.append(f"\n{view.error}", style="red")
    return text


def watch_line(watch) -> Text:
    """The watch window of the last apply: before, after, verdict."""
    if not watch:
        return Text("no config applied yet", style="dim")
    state = watch.get("state", "")
    style = {
        "kept": "green",
        "rolled_back": "red",
        "rolling_back": "red",
        "watching": "yellow",
    }.get(state, "")
    text = Text(f"last apply at step {watch.get('applied_at')}: ")
    if rolled_back_on_request(watch):
        text.append(watch_verdict(watch))
        return text
    text.append(state.replace("_", " "), style=f"bold {style}")
    text.append(
        f" · before {per_sample_rate(watch.get('before_s_per_sample'))}"
        f" → after {per_sample_rate(watch.get('after_s_per_sample'))}"
    )
    if watch.get("reason"):
        text.append(f"\n{watch['reason']}", style="dim")
    return text


GIB = 2**30


def percent(values: Sequence[float]) -> Series:
    """A percentage on its own scale, 0–100% (above it only when a process uses several cores)."""
    return Series(tuple(values), lo=0.0, hi=100.0, unit="%")


def per_gib(values: Sequence[float], unit: str, top: float | None = None) -> Series:
    """Bytes (or bytes/s) in GiB from 0, up to ``top`` bytes when the quantity has a ceiling."""
    return Series(
        tuple(v / GIB for v in values), lo=0.0, hi=None if top is None else top / GIB, unit=unit
    )


class DevicePanel(Vertical):
    """One GPU: utilisation, memory, power, PCIe and NVLink throughput."""

    ROWS: tuple[tuple[str, str, Callable[[DeviceView], tuple[Series, str]]], ...] = (
        ("util", "utilisation", lambda d: (percent(d.util_pct), pct(_p(d.util_pct)))),
        (
            "mem",
            "memory",
            lambda d: (
                per_gib(d.mem_used, "G", d.mem_total),
                f"{size(_last(d.mem_used))} / {size(d.mem_total)}",
            ),
        ),
        (
            "power",
            "power",
            lambda d: (Series(d.power_w, lo=0.0, unit="W"), f"{number(_last(d.power_w), 0)} W"),
        ),
        ("pcie-tx", "PCIe tx", lambda d: (per_gib(d.pcie_tx, "G/s"), rate(_last(d.pcie_tx)))),
        ("pcie-rx", "PCIe rx", lambda d: (per_gib(d.pcie_rx, "G/s"), rate(_last(d.pcie_rx)))),
        (
            "nvlink-tx",
            "NVLink tx",
            lambda d: (per_gib(d.nvlink_tx, "G/s"), rate(_last(d.nvlink_tx))),
        ),
        (
            "nvlink-rx",
            "NVLink rx",
            lambda d: (per_gib(d.nvlink_rx, "G/s"), rate(_last(d.nvlink_rx))),
        ),
    )

    def __init__(self, name: str):
        super().__init__(name=name, classes="device")

    def compose(self) -> ComposeResult:
        yield Label("", classes="device-title")
        for key, name, _ in self.ROWS:
            yield MetricRow(name, classes=f"metric-{key}")

    _pending: DeviceView | None = None

    def on_mount(self) -> None:
        if self._pending is not None:
            self.show(self._pending)

    def show(self, device: DeviceView) -> None:
        titles = self.query(".device-title").results(Label)
        title = next(titles, None)
        if title is None:  # not composed yet (a busy machine): shown once mounted
            self._pending = device
            return
        self._pending = None
        title.update(f"GPU {device.index} {device.name}".rstrip())
        for key, _, get in self.ROWS:
            series, text = get(device)
            self.query_one(f".metric-{key}", MetricRow).show(
                series, text if series.values else "not reported"
            )


def along_steps(
    view: LiveView, values: Sequence[float], unit: str = "", segmented: bool = True
) -> Series:
    """A per-step series with the job's applies and rollbacks marked; ``segmented``: each
    config's stretch in its own colour (a step time at another batch is another line)."""
    aligned = len(values) == len(view.step_configs)
    return Series(
        tuple(values),
        unit=unit,
        segments=view.step_configs if aligned and segmented else (),
        marks=view.changes if aligned else (),
    )


def training_title(view: LiveView) -> Text:
    """The section's name, and the legend of its marks once there are any."""
    text = Text("training")
    if view.changes:
        text.append("  ▲", style="bold yellow")
        text.append(" apply  ", style="not bold dim")
        text.append("↺", style="bold magenta")
        text.append(" rollback · a colour per config", style="not bold dim")
    return text


def _p(values: Sequence[float]) -> float | None:
    last = _last(values)
    return None if last is None else last / 100


async def sync_children(
    container: Widget, names: list[str], make: Callable[[str], Widget]
) -> list[Widget]:
    """Make ``container``'s children one per name, in order (rebuilt only when the names change)."""
    if [c.name for c in container.children] != names:
        await container.remove_children()
        await container.mount_all([make(n) for n in names])
    return list(container.children)


class LiveScreen(TunekitScreen):
    """See the module docstring."""

    FOLLOWS = (("live_view", "show_live"),)

    def compose_body(self) -> ComposeResult:
        yield Static(id="job-line")
        # Two columns side by side; one column, scrolled as a whole, on a narrow terminal.
        with ScrollableContainer(id="live-body"):
            with Vertical(id="training"):
                yield Label("training", classes="section", id="training-title")
                yield MetricRow("step time", id="step-time")
                yield MetricRow("samples/s", id="throughput")
                yield MetricRow("loss", id="loss")
                yield Label("config now", classes="section")
                yield ConfigPanel(id="current-config")
                yield Static(id="watch-line")
            with Vertical(id="hardware"):
                yield Label("devices (NVML)", classes="section")
                yield Static(id="no-gpu")
                yield Vertical(id="devices")
                yield Label("ranks (host)", classes="section")
                yield MetricRow("system CPU", id="system-cpu")
                yield Vertical(id="ranks")

    _rebuilding: asyncio.Lock | None = None
    """One update at a time: an update may rebuild the device and rank lists."""

    async def show_live(self, view: LiveView) -> None:
        if self._rebuilding is None:
            self._rebuilding = asyncio.Lock()
        async with self._rebuilding:
            await self._show_live(view)

    async def _show_live(self, view: LiveView) -> None:
        self.set_class(not view.gpu, "-no-gpu")
        self.set_class(
            view.status not in ("running", "starting", "relaunching", "paused"), "-stopped"
        )
        self.query_one("#job-line", Static).update(job_line(view))
        self.query_one("#training-title", Label).update(training_title(view))
        self.query_one("#step-time", MetricRow).show(
            along_steps(view, view.step_ms, "ms"), ms(view.step_s)
        )
        self.query_one("#throughput", MetricRow).show(
            along_steps(view, view.samples_rate), number(view.samples_per_s)
        )
        self.query_one("#loss", MetricRow).show(
            along_steps(view, view.losses, segmented=False), number(view.loss, 4)
        )
        self.query_one("#current-config", ConfigPanel).show(view.config)
        self.query_one("#watch-line", Static).update(watch_line(view.watch))
        gpu_notice = next((n for n in view.notices if "GPU" in n or "NVML" in n), "no GPU sampled")
        self.query_one("#no-gpu", Static).update(Text(gpu_notice, style="yellow"))
        self.query_one("#system-cpu", MetricRow).show(
            percent(view.system_cpu), pct(_p(view.system_cpu))
        )

        panels = await sync_children(
            self.query_one("#devices", Vertical),
            [f"gpu-{d.index}" for d in view.devices],
            DevicePanel,
        )
        # zip, not strict: while the app shuts down a mount may not happen at all.
        for panel, d in zip(panels, view.devices, strict=False):
            panel.show(d)
        rows = await sync_children(
            self.query_one("#ranks", Vertical),
            [f"rank-{r.rank}" for r in view.ranks],
            lambda n: MetricRow(f"rank {n[5:]} CPU", name=n),
        )
        for row, r in zip(rows, view.ranks, strict=False):
            row.show(percent(r.cpu_pct), f"{number(_last(r.cpu_pct), 0)}% · {size(r.rss_bytes)}")
