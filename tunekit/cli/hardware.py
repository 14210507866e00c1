"""``tunekit hardware``: measure this machine (``probe``) or check a profile (``show``)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import click

from tunekit.cli.common import STORE_OPTION, Table, console, ensure_writable, styled
from tunekit.hardware import GB, CollectiveFit, Hardware, list_profiles, load_profile


@click.group("hardware")
def hardware_group() -> None:
    """Hardware models: measure this machine or validate and print a profile."""


@hardware_group.command("probe")
@click.option(
    "--nproc",
    type=click.IntRange(min=2),
    default=2,
    show_default=True,
    help="Ranks to measure collectives across.",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=9,
    show_default=True,
    help="Timed repeats per message size (after 2 warm-up rounds).",
)
@click.option(
    "--save",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the measured profile as TOML.",
)
@STORE_OPTION
@click.option("--no-store", is_flag=True, help="Do not cache the fits in the study store.")
def probe_cmd(nproc, repeats, save, store_dir, no_store):
    """Measure all-reduce and point-to-point (and host<->GPU copies) on this machine.

    Each sweep over message sizes is fitted to latency + bytes/bandwidth; the
    fits are cached in the study store (so `tunekit plan`/`auto` use them) and,
    with --save, written as a hardware profile.
    """
    from tunekit.observe.probe import hardware_to_toml, probe_hardware

    # Where the results go must be writable before minutes of measuring, not after.
    if not no_store:
        ensure_writable(store_dir, "the study store folder (--store)")
    if save is not None:
        ensure_writable(save.parent, "the folder of --save")
    with console.status(f"measuring collectives on {nproc} ranks"):
        result = probe_hardware(nproc, repeats=repeats)
    hw = result.hardware
    table = Table(title=f"measured on {hw.name} ({result.wall_s:.0f} s)", title_justify="left")
    for c in ("op", "backend", "ranks", "latency µs", "bandwidth GB/s", "95% GB/s", "fit residual"):
        table.add_column(c, justify="left" if c in ("op", "backend") else "right")
    for s in result.sweeps:
        f = s.fit
        table.add_row(
            s.op,
            s.backend,
            str(s.world_size),
            f"{f.latency * 1e6:.1f}",
            f"{f.bandwidth / GB:.3f}",
            _interval_gbs(f),
            f"{100 * f.residual:.1f}%",
        )
    console.print(table)
    points = Table(title="sweep points (median time per size)", title_justify="left")
    points.add_column("bytes", justify="right")
    for s in result.sweeps:
        points.add_column(f"{s.op} µs", justify="right")
    for i, (nbytes, _) in enumerate(result.sweeps[0].points):
        points.add_row(
            f"{nbytes:,}",
            *(f"{s.points[i][1] * 1e6:.1f}" if i < len(s.points) else "—" for s in result.sweeps),
        )
    console.print(points)
    if save is not None:
        save.parent.mkdir(parents=True, exist_ok=True)
        save.write_text(hardware_to_toml(hw))
        console.print(f"profile written to {save}")
    if not no_store:
        from tunekit.observe.static import probe_cache_key
        from tunekit.store import Store

        store = Store.open_default(store_dir)
        try:
            store.cache_put(probe_cache_key(hw), [asdict(f) for f in hw.collectives])
        finally:
            store.close()
        console.print(f"fits cached in {store_dir} for plans on this machine")


@hardware_group.command("show")
@click.argument("profile", required=False)
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Without PROFILE: ranks this machine is described for.",
)
@click.option(
    "--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True
)
@STORE_OPTION
def show_cmd(profile, nproc, device, store_dir):
    """Validate and print PROFILE: a TOML file or a shipped profile's name (`tunekit hardware list`).

    Without PROFILE: this machine as tunekit plans for it, with the collective
    fits `tunekit hardware probe` cached in the store (if any).
    """
    print_hardware(load_profile(profile) if profile else local_hardware(nproc, device, store_dir))


def local_hardware(nproc: int, device: str, store_dir: Path) -> Hardware:
    """This machine's model, as ``tunekit auto`` builds it (with cached probe fits)."""
    import torch

    from tunekit.observe.local import describe_local_machine
    from tunekit.observe.static import probe_cache_key
    from tunekit.store import Store

    device_type = "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"
    hw = describe_local_machine(nproc, device_type)
    db = Path(store_dir) / "tunekit.db"
    if db.exists():
        store = Store(db)
        try:
            fits = store.cache_get(probe_cache_key(hw))
        finally:
            store.close()
        if fits:
            hw = describe_local_machine(nproc, device_type, tuple(CollectiveFit(**f) for f in fits))
    if not hw.collectives:
        console.print(
            "no collective fits cached for this machine: `tunekit hardware probe` measures them",
            style="dim",
        )
    return hw


@hardware_group.command("list")
def list_cmd():
    """The shipped hardware profiles."""
    table = Table(title="shipped hardware profiles", title_justify="left")
    for c in ("name", "devices", "description"):
        table.add_column(c)
    for name in list_profiles():
        hw = load_profile(name)
        table.add_row(name, str(len(hw.devices)), hw.description)
    console.print(table)


def print_hardware(hw: Hardware) -> None:
    """Devices, links and fits of ``hw`` as tables."""
    console.print(styled("[bold]{}[/] — {}", hw.name, hw.description or "no description"))
    console.print(
        f"host: {hw.host.cores} cores, {hw.host.memory_bytes / GB:.0f} GB"
        + (f", sockets {', '.join(hw.host.sockets)}" if hw.host.sockets else "")
        + f" · fingerprint {hw.fingerprint()}"
    )
    devices = Table(title="devices", title_justify="left")
    for c in ("name", "kind", "model", "memory GB", "peak TFLOP/s"):
        devices.add_column(c, justify="right" if c in ("memory GB", "peak TFLOP/s") else "left")
    for d in hw.devices:
        devices.add_row(
            d.name, d.kind, d.model, f"{d.memory_bytes / GB:.1f}", f"{d.peak_flops / 1e12:.2f}"
        )
    console.print(devices)
    if hw.links:
        links = Table(title="links", title_justify="left")
        for c in ("between", "kind", "bandwidth GB/s", "latency µs"):
            links.add_column(c, justify="right" if "/" in c or "µs" in c else "left")
        for lk in hw.links:
            links.add_row(
                f"{lk.a} — {lk.b}", lk.kind, f"{lk.bandwidth / GB:.2f}", f"{lk.latency * 1e6:.1f}"
            )
        console.print(links)
    if hw.switches:
        console.print(f"switches: {', '.join(hw.switches)}")
    if hw.collectives:
        fits = Table(title="collective fits", title_justify="left")
        for c in ("op", "backend", "ranks", "latency µs", "bandwidth GB/s", "95% GB/s", "residual"):
            fits.add_column(c)
        for f in hw.collectives:
            fits.add_row(
                f.op,
                f.backend,
                str(f.world_size),
                f"{f.latency * 1e6:.1f}",
                f"{f.bandwidth / GB:.3f}",
                _interval_gbs(f),
                f"{100 * f.residual:.1f}%",
            )
        console.print(fits)


def _interval_gbs(fit: CollectiveFit) -> str:
    """``low–high`` of a fit's bandwidth interval in GB/s, or a dash when it has none."""
    if fit.bandwidth_interval is None:
        return "—"
    low, high = fit.bandwidth_interval
    return f"{low / GB:.2f}–{high / GB:.2f}"
