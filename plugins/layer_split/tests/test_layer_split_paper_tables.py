"""DeePa's Tables 2 and 3 (papers/NOTES.md section 1), reproduced by the cost model and search.

The compute columns are the paper's measurements on K80s; transfer and update
columns come from our model (paper convention) at the k80x16 profile's
calibrated 2.25 GB/s. The paper multiplies a per-copy time already rounded to
one decimal (8.4 ms), so its 16-copy entries sit ~0.2 ms above the exact
product; we compare at that rounding.
"""

from __future__ import annotations

import dataclasses

import pytest

from tunekit.hardware import CollectiveFit, load_profile
from tunekit.plugins.layer_split.model import (
    CostOptions,
    OpSpec,
    SplitConfig,
    Use,
    Window,
    build_tables,
)
from tunekit.plugins.layer_split.search import evaluate, search

MS = 1e-3


def _paper_compute(column: dict[SplitConfig, float]):
    def compute(spec, cfg):
        return column.get(cfg, 0.0) * MS if spec.name != "prev" else 0.0

    return compute


def _row(plan, layer):
    return next(r for r in plan.rows if r.layer == layer)


# -- Table 2: AlexNet FC1, 16 GPUs, batch 512 ----------------------------------------------

FC1_PARAMS = 9216 * 4096 + 4096
TABLE2 = {  # config: (transfer, compute, update, total) in ms
    SplitConfig(n=16): (0.0, 1.28, 1075.0, 1076.0),
    SplitConfig(c=16): (134.4, 1.28, 0.0, 135.7),
    SplitConfig(c=4): (33.6, 5.1, 0.0, 38.7),
    SplitConfig(c=2): (16.8, 10.2, 0.0, 27.0),
    SplitConfig(): (8.4, 20.4, 0.0, 28.8),
}


def alexnet_fc1_tables():
    hw = load_profile("k80x16")
    # The last pool of AlexNet, image-parallel like all its conv layers; FC1 reads it flattened.
    prev = OpSpec("prev", "pool", (512, 256, 6, 6), 4, (512, 9216), (True,) * 4, 0, 0.0)
    fc1 = OpSpec(
        "fc1",
        "linear",
        (512, 4096, 1, 1),
        2,
        (512, 4096),
        (True, True, False, False),
        FC1_PARAMS * 4,
        2.0 * 512 * 9216 * 4096,
        channel_rule="all",
        uses=[Use("prev", direct=False)],
    )
    spaces = {"prev": [SplitConfig(n=16)], "fc1": list(TABLE2)}
    compute = _paper_compute({c: v[1] for c, v in TABLE2.items()})
    return build_tables({"prev": prev, "fc1": fc1}, hw, 16, CostOptions(), compute, "paper", spaces)


@pytest.mark.parametrize("cfg", list(TABLE2))
def test_table2_rows(cfg):
    tables = alexnet_fc1_tables()
    row = _row(evaluate(tables, {"prev": SplitConfig(n=16), "fc1": cfg}), "fc1")
    transfer, compute, update, total = TABLE2[cfg]
    copies = transfer / 8.4 if transfer else 0
    assert row.xfer_s / MS == pytest.approx(copies * 8.389, abs=0.01)  # 18.87 MB per copy
    assert round(row.xfer_s / MS / max(copies, 1), 1) == pytest.approx(8.4 if copies else 0.0)
    assert row.compute_s / MS == pytest.approx(compute)
    if update:
        # 16 replicas x 151 MB / 2.25 GB/s; the paper's 1075 is 128 of its rounded 8.4 ms units.
        assert row.update_s / MS == pytest.approx(16 * FC1_PARAMS * 4 / 2.25e6)
        assert round(row.update_s / MS / 128, 1) == 8.4
    else:
        assert row.update_s == 0
    tol = 0.25 if copies == 16 else 1.5 if update else 0.05
    assert row.total_s / MS == pytest.approx(total, abs=tol)


def test_table2_optimum_is_two_channel_workers():
    tables = alexnet_fc1_tables()
    best = search(tables, "best")
    assert best.configs["fc1"] == SplitConfig(n=1, c=2)
    assert best.cost_s / MS == pytest.approx(27.0, abs=0.05)
    owt = search(tables, "owt")
    assert owt.configs["fc1"] == SplitConfig(c=16)
    assert owt.cost_s / MS == pytest.approx(135.7, abs=0.25)
    assert owt.cost_s / best.cost_s == pytest.approx(5.0, rel=0.01)  # "5x below OWT"
    assert search(tables, "image").configs["fc1"] == SplitConfig(n=16)


# -- Table 3: VGG-16's last three convs as one node ----------------------------------------

TABLE3 = {
    SplitConfig(n=16): (0.0, 15.9, 134.4, 150.3),
    SplitConfig(n=8): (39.2, 31.8, 67.2, 138.2),
    SplitConfig(n=4): (39.2, 63.7, 33.6, 136.5),
    SplitConfig(h=2, w=2): (39.2, 54.7, 33.6, 127.5),
    SplitConfig(n=2): (39.2, 127.4, 16.8, 183.4),
}


def vgg_last_convs_tables():
    """The table's bytes do not match VGG-16's own (its 28 MB of conv5 weights would take
    12.6 ms per replica at 2.25 GB/s, not 8.4): we take a tensor and weights whose sizes
    give the table's per-copy times, and check that the model charges them as the table does."""
    shape = (512, 512, 14, 14)
    tensor_bytes = 4 * 512 * 512 * 14 * 14
    hw = load_profile("k80x16")
    rate = tensor_bytes / (39.2 * MS)
    hw = dataclasses.replace(hw, collectives=(CollectiveFit("model", "p2p", 16, 0.0, rate),))
    win = Window(3, 1, 1)
    prev = OpSpec(
        "prev", "conv", shape, 4, shape, (True,) * 4, 0, 0.0, channel_rule="all", windows=(win, win)
    )
    last = OpSpec(
        "last3",
        "conv",
        shape,
        4,
        shape,
        (True,) * 4,
        round(8.4 * MS * rate),
        0.0,
        channel_rule="all",
        windows=(win, win),
        uses=[Use("prev", direct=True)],
    )
    spaces = {"prev": [SplitConfig(n=16)], "last3": list(TABLE3)}
    compute = _paper_compute({c: v[1] for c, v in TABLE3.items()})
    return build_tables(
        {"prev": prev, "last3": last}, hw, 16, CostOptions(), compute, "paper", spaces
    )


@pytest.mark.parametrize("cfg", list(TABLE3))
def test_table3_rows(cfg):
    row = _row(
        evaluate(vgg_last_convs_tables(), {"prev": SplitConfig(n=16), "last3": cfg}), "last3"
    )
    transfer, compute, update, total = TABLE3[cfg]
    assert row.xfer_s / MS == pytest.approx(transfer, abs=0.01)  # halos are not charged
    assert row.compute_s / MS == pytest.approx(compute)
    assert row.update_s / MS == pytest.approx(update, abs=0.01)  # replicas = n*h*w
    assert row.total_s / MS == pytest.approx(total, abs=0.05)


def test_table3_optimum_is_spatial_and_image_only_picks_four_workers():
    tables = vgg_last_convs_tables()
    best = search(tables, "best")
    assert best.configs["last3"] == SplitConfig(h=2, w=2)
    assert best.cost_s / MS == pytest.approx(127.5, abs=0.05)
    image_only = search(tables, "image_search")
    assert image_only.configs["last3"] == SplitConfig(n=4)
    assert image_only.cost_s / MS == pytest.approx(136.5, abs=0.05)
    assert search(tables, "image").cost_s / MS == pytest.approx(150.3, abs=0.05)


def test_exact_bytes_variant_counts_halo_and_residency():
    """The exact variant charges what really moves: halos, and nothing already on the device."""
    tables = vgg_last_convs_tables()
    exact = build_tables(
        tables.specs,
        load_profile("k80x16"),
        16,
        CostOptions(xfer="exact", update="exact"),
        spaces=tables.spaces,
    )
    rows = {
        c: _row(evaluate(exact, {"prev": SplitConfig(n=16), "last3": c}), "last3") for c in TABLE3
    }
    # n=8 from n=16: worker k needs samples [64k, 64k+64); device k holds [32k, 32k+32) of them.
    per_sample = 512 * 14 * 14 * 4
    moved_n8 = sum(
        64 - max(0, min(64 * k + 64, 32 * k + 32) - max(64 * k, 32 * k)) for k in range(8)
    )
    assert rows[SplitConfig(n=8)].xfer_bytes == pytest.approx(2 * moved_n8 * per_sample)
    assert rows[SplitConfig(n=16)].xfer_bytes == 0
    # h2w2 needs an 8x8 (halo) window per worker instead of 7x7, all samples.
    assert rows[SplitConfig(h=2, w=2)].xfer_bytes > rows[SplitConfig(n=4)].xfer_bytes
    # A ring all-reduce moves 2(r-1)/r of the weights per replica: 2(r-1) x P in all.
    weights = tables.specs["last3"].param_bytes
    assert rows[SplitConfig(n=16)].update_bytes == pytest.approx(2 * 15 * weights)
    assert rows[SplitConfig(h=2, w=2)].update_bytes == pytest.approx(2 * 3 * weights)
    assert rows[SplitConfig(n=2)].update_bytes == pytest.approx(2 * 1 * weights)
