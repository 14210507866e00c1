"""The step model's arithmetic, on hand-made units and collectives."""

from __future__ import annotations

import pytest

from tunekit.api import Layout
from tunekit.plugins.sharding.model import (
    Collectives,
    Setting,
    StepModel,
    Unit,
    Wire,
    backward_exposed,
    pipeline_exposed,
)

MiB = 2**20


def model(device_type: str = "cpu", world: int = 2, bandwidth: float = 1e9) -> StepModel:
    blocks = tuple(Unit(f"blocks.{i}", 1e-3, 2e-3, 4e-4, 4 * MiB) for i in range(4))
    return StepModel(
        root=Unit("", 5e-4, 1e-3, 5e-4, 2 * MiB),
        blocks=blocks,
        per_pass_s=0.01,
        optimizer_s=0.02,
        world_size=world,
        gather_ratio=1.0,
        collectives=Collectives.from_all_reduce(Wire(1e-4, bandwidth)),
        device_type=device_type,
    )


def setting(micro: int = 1, **layout) -> Setting:
    return Setting(Layout(**layout), micro, 16)


def test_all_gather_and_reduce_scatter_are_halves_of_a_ring_all_reduce():
    c = Collectives.from_all_reduce(Wire(2e-4, 1e9))
    n = 64 * MiB
    assert c.all_gather.time(n) + c.reduce_scatter.time(n) == pytest.approx(c.all_reduce.time(n))
    assert c.all_gather.time(0) == 0.0


def test_checkpointing_adds_the_recomputation_of_the_checkpointed_blocks_only():
    m = model()
    plain = m.compute_s(setting())
    full = m.compute_s(setting(checkpointing="full"))
    every_2nd = m.compute_s(setting(checkpointing="full", checkpoint_every=2))
    selective = m.compute_s(setting(checkpointing="selective"))
    named = m.compute_s(setting(checkpointing="full", checkpoint_blocks=("blocks.3",)))
    assert full - plain == pytest.approx(16 * 4 * 1e-3)  # every block's forward again
    assert every_2nd - plain == pytest.approx(16 * 2 * 1e-3)  # blocks 0 and 2
    assert selective - plain == pytest.approx(16 * 4 * 4e-4)  # the cheap operations only
    assert named - plain == pytest.approx(16 * 1e-3)


def test_micro_batches_cost_a_pass_each_and_keep_the_samples():
    m = model()
    assert m.compute_s(setting(micro=4)) - m.compute_s(setting()) == pytest.approx(3 * 0.01)
    assert setting(micro=4).micro_batch == 4
    with pytest.raises(ValueError):
        setting(micro=3)


def test_ddp_all_reduces_once_per_step_whatever_the_micro_batches():
    m = model()
    one, four = m.comm_s(setting()), m.comm_s(setting(micro=4))
    assert one[0] == four[0] == pytest.approx(m.collectives.all_reduce.time(18 * MiB))
    assert 0 < one[1] <= one[0]


def test_fsdp_gathers_again_in_backward_when_resharded_and_per_micro_batch():
    m = model()
    kept = m.comm_s(setting(sharding="fsdp", reshard_after_forward=False))[0]
    resharded = m.comm_s(setting(sharding="fsdp", reshard_after_forward=True))[0]
    gather_blocks = 4 * m.collectives.all_gather.time(4 * MiB)
    assert resharded - kept == pytest.approx(gather_blocks)
    two = m.comm_s(setting(2, sharding="fsdp", reshard_after_forward=False))[0]
    assert two == pytest.approx(2 * kept)


def test_forward_gathers_hide_behind_compute_on_an_accelerator_not_on_a_cpu():
    slow = 2e6  # the link: a block's gather takes ~2 s against ~16 ms of compute
    cpu = model("cpu", bandwidth=slow).comm_s(setting(sharding="fsdp"))
    gpu = model("cuda", bandwidth=slow).comm_s(setting(sharding="fsdp"))
    assert cpu[0] == pytest.approx(gpu[0])
    fast = 1e12
    cpu = model("cpu", bandwidth=fast).comm_s(setting(sharding="fsdp"))
    gpu = model("cuda", bandwidth=fast).comm_s(setting(sharding="fsdp"))
    assert gpu[1] < cpu[1]  # prefetched gathers hide behind the blocks' forward


def test_offload_and_the_sharded_optimizer():
    cpu, gpu = model("cpu"), model("cuda")
    sharded = setting(sharding="fsdp")
    offloaded = setting(sharding="fsdp", cpu_offload=True)
    assert cpu.optimizer_part_s(sharded.layout) == pytest.approx(0.01)  # half the state
    assert cpu.comm_s(offloaded) == cpu.comm_s(sharded)  # the host is the device
    assert gpu.comm_s(offloaded)[1] > gpu.comm_s(sharded)[1]  # the copies are exposed
    assert gpu.optimizer_part_s(offloaded.layout) > gpu.optimizer_part_s(sharded.layout)


def test_one_rank_communicates_nothing():
    m = model(world=1)
    assert m.comm_s(setting(sharding="fsdp")) == (0.0, 0.0)
    assert m.optimizer_part_s(Layout(sharding="fsdp")) == pytest.approx(0.02)


def test_pipelines_expose_what_the_compute_before_cannot_cover():
    assert pipeline_exposed([1.0, 1.0, 3.0], [2.0, 2.0, 2.0]) == pytest.approx(1.0 + 0 + 1.0)
    # Stage 0 covers the next gather (0.5) but not it plus nothing else; the last
    # reduce-scatter and the first gather wait whole.
    assert backward_exposed([0.2, 0.5, 0.0], [0.3, 0.3, 0.4], [1.0, 0.1, 1.0]) == pytest.approx(
        0.2 + 0.4 + 0.0 + (0.3 - 0.1) + 0.0
    )
    assert backward_exposed([], [], []) == 0.0


def test_fsdp_adds_its_own_compute_per_pass():
    m = StepModel(**{**model().__dict__, "fsdp_pass_s": (0.003, 0.001)})
    plain = m.compute_s(setting(2))
    assert m.compute_s(setting(2, sharding="fsdp")) - plain == pytest.approx(2 * 0.003)
    kept = m.compute_s(setting(2, sharding="fsdp", reshard_after_forward=False))
    assert kept - plain == pytest.approx(2 * 0.001)


def test_a_split_into_a_timed_micro_batch_costs_its_timed_pass():
    m = StepModel(**{**model().__dict__, "pass_times": ((4, 0.05), (16, 0.3))})
    assert m.compute_s(setting(4)) == pytest.approx(4 * 0.05)  # 4 passes of 4, as timed
    assert m.compute_s(setting(1)) == pytest.approx(0.3)
    untimed = m.compute_s(setting(2))  # 8 samples a pass: the line
    assert untimed == pytest.approx(2 * (0.01 + 8 * (1.5e-3 + 4 * 3e-3)))
