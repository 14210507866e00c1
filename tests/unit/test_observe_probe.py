"""The probe's fit, the local machine with measured links, profiles written as TOML, the CLI."""

from __future__ import annotations

import json
import re
from dataclasses import asdict

import pytest
from click.testing import CliRunner

from tunekit.errors import HardwareError
from tunekit.hardware import GB, CollectiveFit, Hardware, load_profile
from tunekit.observe.local import describe_local_machine
from tunekit.observe.probe import fit_latency_bandwidth, hardware_to_toml


def test_fit_recovers_latency_and_bandwidth_exactly():
    lat, bw = 50e-6, 2.5 * GB
    pts = [(n, lat + n / bw) for n in (4096, 65536, 2**20, 2**24)]
    fit = fit_latency_bandwidth(pts, "gloo", "all_reduce", 2)
    assert fit.latency == pytest.approx(lat, rel=1e-9)
    assert fit.bandwidth == pytest.approx(bw, rel=1e-9)
    assert fit.residual == pytest.approx(0.0, abs=1e-12)
    assert (fit.backend, fit.op, fit.world_size) == ("gloo", "all_reduce", 2)


def test_fit_weighs_relative_error_and_reports_the_residual():
    # +10% on the smallest message, -10% on the largest: a relative fit keeps both in view.
    lat, bw = 100e-6, 1 * GB
    sizes = (1024, 2**16, 2**20, 2**24)
    noise = (1.1, 1.0, 1.0, 0.9)
    pts = [(n, (lat + n / bw) * k) for n, k in zip(sizes, noise, strict=True)]
    fit = fit_latency_bandwidth(pts, "gloo", "p2p", 2)
    assert 0.03 < fit.residual < 0.1
    assert fit.latency > 0 and fit.bandwidth > 0
    with pytest.raises(ValueError):
        fit_latency_bandwidth(pts[:1], "gloo", "p2p", 2)


def test_local_machine_takes_links_from_the_p2p_fit():
    p2p = CollectiveFit("gloo", "p2p", 2, 80e-6, 3 * GB, 0.05)
    ar = CollectiveFit("gloo", "all_reduce", 2, 200e-6, 1.5 * GB, 0.1)
    hw = describe_local_machine(2, "cpu", (ar, p2p))
    assert hw.source == "probe"
    assert hw.transfer_time("rank0", "rank1", 0) == pytest.approx(80e-6)  # two hops of half each
    assert hw.path_bandwidth("rank0", "rank1") == pytest.approx(3 * GB)
    assert hw.allreduce_time(1e6, 2) == pytest.approx(ar.time(1e6))
    plain = describe_local_machine(2, "cpu")
    assert plain.source == "local" and plain.fingerprint() == hw.fingerprint()


def test_probe_profile_round_trips_through_toml(tmp_path):
    fits = (
        CollectiveFit("gloo", "all_reduce", 2, 210e-6, 1.25 * GB, 0.12),
        CollectiveFit("gloo", "p2p", 2, 75e-6, 2.5 * GB, 0.08),
    )
    hw = describe_local_machine(2, "cpu", fits)
    path = tmp_path / "probe.toml"
    path.write_text(hardware_to_toml(hw))
    again = load_profile(path)
    assert again.name == hw.name and again.fingerprint() == hw.fingerprint()
    assert [d.name for d in again.devices] == ["rank0", "rank1"]
    for a, b in zip(again.collectives, hw.collectives, strict=True):
        assert (a.op, a.backend, a.world_size) == (b.op, b.backend, b.world_size)
        assert a.latency == pytest.approx(b.latency) and a.bandwidth == pytest.approx(b.bandwidth)
        assert a.residual == pytest.approx(b.residual)
    assert again.links[0].bandwidth == pytest.approx(hw.links[0].bandwidth)


def test_intervals_round_trip_through_toml_and_the_store(tmp_path):
    from tunekit.observe.static import observe_static, probe_cache_key
    from tunekit.store import Store

    fits = (
        CollectiveFit(
            "gloo", "all_reduce", 2, 210e-6, 1.25 * GB, 0.12, (190e-6, 260e-6), (1.1 * GB, 1.4 * GB)
        ),
        CollectiveFit("gloo", "p2p", 2, 75e-6, 2.5 * GB, 0.08),  # no interval: stays without one
    )
    hw = describe_local_machine(2, "cpu", fits)
    path = tmp_path / "probe.toml"
    path.write_text(hardware_to_toml(hw))
    assert "bandwidth_gb_s_interval = [1.1, 1.4]" in path.read_text()
    again = load_profile(path)
    ar = again.fit("all_reduce", 2)
    assert ar.bandwidth_interval == pytest.approx((1.1 * GB, 1.4 * GB))
    assert ar.latency_interval == pytest.approx((190e-6, 260e-6))
    assert again.fit("p2p", 2).bandwidth_interval is None
    # the study store keeps fits as JSON (tuples come back as lists): they compare equal
    store = Store.open_default(tmp_path / "store")
    try:
        store.cache_put(probe_cache_key(hw), [asdict(f) for f in fits])
        static = observe_static("example:cnn", 2, "cpu", None, store, time_layers=False)
    finally:
        store.close()
    assert static.hardware.collectives == fits


def test_old_cached_fits_and_profiles_without_intervals_still_load(tmp_path):
    from tunekit.observe.static import observe_static, probe_cache_key
    from tunekit.store import Store

    # What `tunekit hardware probe` cached before fits carried intervals.
    old = [
        {
            "backend": "gloo",
            "op": "all_reduce",
            "world_size": 2,
            "latency": 2.1e-4,
            "bandwidth": 1.25e9,
            "residual": 0.12,
        },
        {
            "backend": "gloo",
            "op": "p2p",
            "world_size": 2,
            "latency": 7.5e-5,
            "bandwidth": 2.5e9,
            "residual": 0.08,
        },
    ]
    store = Store.open_default(tmp_path)
    try:
        store.cache_put(probe_cache_key(describe_local_machine(2, "cpu")), old)
        hw = observe_static("example:cnn", 2, "cpu", None, store, time_layers=False).hardware
    finally:
        store.close()
    ar = hw.fit("all_reduce", 2, "gloo")
    assert (ar.latency, ar.bandwidth, ar.bandwidth_interval) == (2.1e-4, 1.25e9, None)
    assert hw.at_end("slow") == hw == hw.at_end("fast")  # no interval: both ends are the value
    assert Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw
    # ... and a profile written before then
    path = tmp_path / "old.toml"
    path.write_text(
        'name = "old"\n[host]\ncores = 2\nmemory_gb = 8\n'
        '[[devices]]\nname = "rank"\ncount = 2\nkind = "cpu"\nmodel = "x"\nmemory_gb = 4\npeak_tflops = 0.1\n'
        '[[collectives]]\nbackend = "gloo"\nop = "all_reduce"\nworld_size = 2\n'
        "latency_us = 210\nbandwidth_gb_s = 1.25\nresidual = 0.12\n"
    )
    fit = load_profile(path).fit("all_reduce", 2)
    assert fit.bandwidth == pytest.approx(1.25 * GB) and fit.bandwidth_interval is None


@pytest.mark.parametrize(
    ("interval", "message"),
    [
        ("[2]", "must be [low, high]"),
        ("[3, 2]", "has low 3.0 > high 2.0"),
        ('["a", 2]', "must be a number"),
    ],
)
def test_a_bad_interval_in_a_profile_is_one_line(tmp_path, interval, message):
    path = tmp_path / "bad.toml"
    path.write_text(
        'name = "x"\n[host]\ncores = 2\nmemory_gb = 8\n'
        '[[devices]]\nname = "g"\nkind = "gpu"\nmodel = "m"\nmemory_gb = 16\npeak_tflops = 1\n'
        '[[collectives]]\nbackend = "nccl"\nop = "all_reduce"\nworld_size = 1\n'
        f"latency_us = 20\nbandwidth_gb_s = 60\nbandwidth_gb_s_interval = {interval}\n"
    )
    with pytest.raises(HardwareError, match=re.escape(message)) as err:
        load_profile(path)
    assert "collectives[0].bandwidth_gb_s_interval" in str(err.value)


# -- tunekit hardware show ------------------------------------------------------------------


def _show(arg: str):
    from tunekit.cli.hardware import hardware_group

    return CliRunner().invoke(hardware_group, ["show", arg])


def test_show_prints_a_shipped_profile():
    res = _show("dgx1-v100x4")
    assert res.exit_code == 0, res.output
    assert "Tesla V100" in res.output and "nvlink" in res.output


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'name = "x"\n[host]\ncores = 2\n[[devices]]\nname="g"\nkind="gpu"\nmodel="m"\nmemory_gb=1\npeak_tflops=1\n',
            "missing field host.memory_gb",
        ),
        (
            'name = "x"\n[host]\ncores = 2\nmemory_gb = 8\n[[devices]]\nname="g"\nkind="gpu"\nmodel="m"\nmemory_gb=-16\npeak_tflops=1\n',
            "field devices[0].memory_gb must be >= 0.0, not -16",
        ),
        (
            'name = "x"\n[host]\ncores = 2\nmemory_gb = 8\n[[devices]]\nname="g"\ncount=2\nkind="gpu"\nmodel="m"\nmemory_gb=16\npeak_tflops=1\n'
            '[[links]]\nbetween=["g0","g1"]\nbandwidth_gb_s=25\nlatency_us=-5\n',
            "field links[0].latency_us must be >= 0.0, not -5",
        ),
    ],
)
def test_show_rejects_missing_or_negative_fields_in_one_line(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    res = _show(str(path))
    assert isinstance(res.exception, HardwareError)
    assert message in str(res.exception) and "\n" not in str(res.exception)


def test_show_unknown_profile_names_the_shipped_ones():
    res = _show("no-such-machine")
    assert isinstance(res.exception, HardwareError)
    assert "dgx1-v100x4" in str(res.exception)


def test_cli_exit_code_two_once_registered(tmp_path):
    from tunekit.cli import main as cli_main

    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n')
    assert cli_main.main(["hardware", "show", str(bad)]) == 2
    assert cli_main.main(["hardware", "show", "k80x16"]) == 0


def test_a_baseline_trials_probe_read_back_from_its_rank_file_fits_as_the_probe_does():
    """Issue 35: the first baseline trial's ranks time the collectives (no ranks of their own);
    rank 0's timings come back through JSON, sizes as strings, and fit this machine."""
    from tunekit.observe.probe import probe_result

    sizes = [4096 * 4**i for i in range(5)]
    timings = {
        "backend": "gloo",
        "all_reduce": {n: [1e-4 + n / 1e9] * 5 for n in sizes},
        "p2p": {n: [5e-5 + n / 3e9] * 5 for n in sizes},
        "wall_s": 1.5,
    }
    result = probe_result(json.loads(json.dumps(timings)), 2, "cpu", 1.5)
    fits = {f.op: f for f in result.hardware.collectives}
    assert set(fits) == {"all_reduce", "p2p"} and result.wall_s == 1.5
    assert fits["all_reduce"].latency == pytest.approx(1e-4, rel=1e-3)
    assert fits["all_reduce"].bandwidth == pytest.approx(1e9, rel=1e-3)
    assert fits["p2p"].bandwidth == pytest.approx(3e9, rel=1e-3)
