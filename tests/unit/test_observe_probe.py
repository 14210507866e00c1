"""The probe's fit, the local machine with measured links, profiles written as TOML, the CLI."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tunekit.errors import HardwareError
from tunekit.hardware import GB, CollectiveFit, load_profile
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
