"""Layouts in one process: fields checked, blocks found, checkpointing bit-exact and switched at
a step boundary, refusals in one line, memory measured and capped, the memory model's parts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from tunekit.errors import ConfigError, WorkloadError
from tunekit.layout import Layout
from tunekit.memory import (
    BlockFacts,
    Line,
    MemoryFacts,
    PolicyFacts,
    calibrate,
    format_bytes,
    parse_size,
    predict,
)
from tunekit.observe.memory import AllocationTracker, MemoryCapExceeded, PeakMeter, account
from tunekit.observe.memory_facts import measure_memory_facts
from tunekit.runtime.dist import single_rank_group
from tunekit.runtime.session import Session
from tunekit.runtime.sharding import model_blocks
from tunekit.runtime.sync import DDPSync
from tunekit.testing import default_dtype, tiny_gpt_workload
from tunekit.trials.exits import is_oom

MiB = 2**20


@pytest.fixture(autouse=True)
def one_thread():
    """Toy models on one thread: a second one only waits for a busy machine's cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"sharding": "zero3"}, "sharding"),
        ({"cpu_offload": True}, "cpu_offload"),  # offload without FSDP
        ({"reshard_after_forward": "yes"}, "reshard_after_forward"),
        ({"checkpointing": "some"}, "checkpointing"),
        ({"checkpoint_every": 0}, "checkpoint_every"),
        ({"checkpoint_blocks": ("blocks.0",)}, "checkpoint_blocks"),  # with checkpointing none
        ({"checkpointing": "full", "checkpoint_blocks": "blocks.0"}, "checkpoint_blocks"),
        ({"sharding": "fsdp", "precision": "fp16"}, "precision"),
    ],
)
def test_a_bad_layout_field_is_named_in_one_line(changes, field):
    with pytest.raises(WorkloadError) as err:
        replace(tiny_gpt_workload(), **changes)
    message = str(err.value)
    assert f"workload 'tiny_gpt': {field} " in message and "\n" not in message


def test_blocks_are_transformer_blocks_else_top_level_children_with_parameters():
    from tunekit.examples.cnn import build_model
    from tunekit.testing.fixtures import TINY_GPT

    gpt = tiny_gpt_workload().model()
    assert model_blocks(gpt) == [f"blocks.{i}" for i in range(TINY_GPT["blocks"])]
    cnn = build_model()  # a Sequential: its children with parameters, ReLUs and pools left out
    names = model_blocks(cnn)
    assert names == [n for n, m in cnn.named_children() if any(True for _ in m.parameters())]
    assert len(names) == 6


def _train(session: Session, steps: int) -> dict[str, torch.Tensor]:
    losses = [session.train_step().loss for _ in range(steps)]
    state = {k: v.clone() for k, v in session.model.state_dict().items()}
    state["losses"] = torch.tensor(losses, dtype=torch.float64)
    return state


def test_checkpointing_alone_is_bit_exact_and_switches_at_a_step_boundary():
    """Recomputing a block's forward gives the same values, so every policy trains to the very
    same parameters as none, and so does a switch between policies mid-run."""
    with default_dtype(torch.float64):
        base = _train(Session(tiny_gpt_workload()), 4)
        for layout in (
            Layout(checkpointing="full"),
            Layout(checkpointing="full", checkpoint_every=2),
            Layout(checkpointing="selective"),
            Layout(checkpointing="full", checkpoint_blocks=("blocks.1",)),
        ):
            s = Session(tiny_gpt_workload(), layout=layout)
            assert s.checkpointed and "checkpointed" in s.features()
            got = _train(s, 4)
            for k in base:
                assert torch.equal(got[k], base[k]), (layout.describe(), k)
        s = Session(tiny_gpt_workload())
        s.train_step()
        s.set_checkpointing("full")
        s.train_step()
        s.set_checkpointing("selective", every=2)
        assert s.checkpointed == ["blocks.0"]
        s.train_step()
        s.set_checkpointing("none")
        assert s.checkpointed == [] and "forward" not in vars(s.model.get_submodule("blocks.0"))
        got = _train(s, 1)
        for k in base:
            assert torch.equal(got[k], base[k] if k != "losses" else got[k]), k
        assert torch.equal(got["losses"][-1:], base["losses"][-1:])


def test_a_reset_returns_to_the_workloads_checkpointing():
    s = Session(replace(tiny_gpt_workload(), checkpointing="full", checkpoint_every=2))
    assert s.checkpointed == ["blocks.0"]
    s.set_checkpointing("selective")
    assert s.checkpointed == ["blocks.0", "blocks.1"]
    s.reset()
    assert s.checkpointed == ["blocks.0"] and s.layout.checkpointing == "full"


def test_a_policy_naming_a_missing_block_is_refused_naming_the_field():
    w = replace(tiny_gpt_workload(), checkpointing="full", checkpoint_blocks=("blocks.9",))
    with pytest.raises(WorkloadError) as err:
        Session(w)
    assert "checkpoint_blocks names blocks.9, which the model does not have" in str(err.value)
    assert "blocks.0, blocks.1" in str(err.value)
    s = Session(tiny_gpt_workload())
    with pytest.raises(ConfigError, match="checkpoint_blocks names blocks.7"):
        s.set_checkpointing("full", blocks=["blocks.7"])
    assert s.checkpointed == []  # refused: nothing changed


def test_fsdp_on_a_model_without_parameters_is_refused_naming_the_field():
    w = replace(tiny_gpt_workload(), model=lambda: nn.Sequential(nn.ReLU()), sharding="fsdp")
    with single_rank_group(), pytest.raises(WorkloadError) as err:
        Session(w)
    assert "sharding='fsdp' needs a model with parameters to shard" in str(err.value)


def test_a_sharded_session_refuses_what_it_cannot_honour_and_what_needs_a_rebuild():
    with single_rank_group():
        s = Session(replace(tiny_gpt_workload(), sharding="fsdp"))
        assert s.grad_sync.name == "fsdp" and "sharded" in s.features()
        with pytest.raises(ConfigError) as err:
            s.set_grad_sync(DDPSync())  # DDP's buckets: a replicated model's
        assert "gradient strategy ddp does not honour sharded" in str(err.value)
        assert s.grad_sync.name == "fsdp"
        s.train_step()
    plain = Session(tiny_gpt_workload())
    with pytest.raises(ConfigError) as err:
        plain.set_layout(Layout(sharding="fsdp"))
    assert "sharding='fsdp' needs the model rebuilt" in str(err.value)
    assert plain.layout == Layout()


# -- measuring -------------------------------------------------------------------------------


def test_the_tracker_sees_known_allocations_and_nests_meters():
    with AllocationTracker(torch.device("cpu")) as tracker:
        start = tracker.current()
        a = torch.ones(2 * MiB)  # 8 MiB
        with PeakMeter(torch.device("cpu")) as meter:  # nests in the running tracker
            b = a * 2  # 8 MiB more
            del b
        assert meter.peak_bytes == pytest.approx(8 * MiB, rel=0.01)
        assert meter.start_bytes - start == pytest.approx(8 * MiB, rel=0.01)
        window = tracker.open()
        c = torch.ones(MiB)
        del c
        assert window.close() - start == pytest.approx(12 * MiB, rel=0.01)
        del a
        assert tracker.current() - start == pytest.approx(0, abs=0.01 * MiB)
    with PeakMeter(torch.device("cpu")) as own:  # no tracker around it: runs its own
        x = torch.ones(MiB)
        del x
    assert own.peak_bytes == pytest.approx(4 * MiB, rel=0.01)


def test_an_address_allocated_again_counts_its_unseen_free():
    """Another thread's free is not reported; the block's address handed out again says it."""
    blocks: dict[int, int] = {}
    running = account(blocks, 0, [(0xA, 100), (0xB, 50)], [])
    assert running == 150
    running = account(blocks, running, [(0xA, 80), (0xB, -50)], [])  # 0xA freed elsewhere
    assert running == 80 and blocks == {0xA: 80}
    assert account(blocks, running, [(0xC, -10)], []) == 80  # a free never counted: ignored


def test_a_step_over_the_cap_fails_as_out_of_memory_and_one_under_it_trains():
    """The cap is set relative to the step's own measured peak: no figure of this machine."""
    w = tiny_gpt_workload()
    probe = Session(w, track_memory=True)
    rec = probe.train_step()
    peak = rec.metrics["peak_bytes"]
    assert peak == probe.memory.max > 0
    probe.close()
    Session(w, memory_cap_bytes=int(peak * 2)).train_step()
    tight = Session(w, memory_cap_bytes=int(peak * 0.5))
    with pytest.raises(MemoryCapExceeded) as err:
        tight.train_step()
    assert is_oom(err.value)
    assert "over the memory cap" in str(err.value) and "(--memory-cap)" in str(err.value)


def test_sizes_parse_and_print():
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512 MiB") == 512 * MiB
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("300M") == 300_000_000
    assert parse_size("1024") == 1024
    for bad in ("lots", "2 parsecs", "0", "-1GiB"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert format_bytes(3 * MiB) == "3.0 MiB"
    assert format_bytes(1536) == "1.5 KiB"


# -- the memory model --------------------------------------------------------------------------


def _facts(blocks: int = 4) -> MemoryFacts:
    """Facts of a made-up model: 100 MiB of parameters, 60 MiB of them in blocks, Adam."""
    per_block = {
        "none": Line(0, 1 * MiB),
        "full": Line(0, 0.1 * MiB),
        "selective": Line(0, 0.5 * MiB),
    }
    kept_all = {p: sum(line.per_sample for _ in range(blocks)) for p, line in per_block.items()}
    start = 2 * MiB  # the loss's and the head's gradients, per sample
    return MemoryFacts(
        param_bytes=100 * MiB,
        grad_bytes=100 * MiB,
        buffer_bytes=0,
        optimizer_bytes=200 * MiB,
        optimizer_temp_bytes=50 * MiB,
        blocks=tuple(BlockFacts(f"b.{i}", 15 * MiB, per_block) for i in range(blocks)),
        policies={
            p: PolicyFacts(Line(0, kept_all[p]), Line(0, kept_all[p] + start), 0.0)
            for p in per_block
        },
        batches=(4, 8),
    )


def test_the_model_divides_what_fsdp_shards_and_adds_what_it_gathers():
    f = _facts()
    ddp = predict(f, Layout(), batch=64, world_size=4)
    fsdp = predict(f, Layout(sharding="fsdp"), batch=64, world_size=4)
    keep = predict(f, Layout(sharding="fsdp", reshard_after_forward=False), batch=64, world_size=4)
    assert ddp.parts["parameters"] == 100 * MiB and ddp.parts["optimizer"] == 200 * MiB
    assert ddp.parts["collective_buffers"] == 100 * MiB  # DDP's buckets
    assert fsdp.parts["parameters"] == 25 * MiB and fsdp.parts["optimizer"] == 50 * MiB
    assert fsdp.parts["gathered_parameters"] == 40 * MiB  # the root's, still gathered
    assert keep.parts["gathered_parameters"] == 100 * MiB  # every block's too
    for p in (ddp, fsdp, keep):
        assert p.moment == "backward"
        assert p.peak_bytes == pytest.approx(sum(p.parts.values()))
        assert p.parts["activations"] == 64 * (4 + 2) * MiB
    small = predict(f, Layout(), batch=1, world_size=4)  # little activation: the update peaks
    assert small.moment == "optimizer" and small.parts["optimizer_temporaries"] == 50 * MiB
    assert fsdp.peak_bytes < keep.peak_bytes < ddp.peak_bytes


def test_checkpointing_and_accumulation_change_the_activations_and_gradients():
    f = _facts()
    full = predict(f, Layout(checkpointing="full"), batch=256, world_size=2)
    half = predict(f, Layout(checkpointing="full", checkpoint_every=2), batch=256, world_size=2)
    named = predict(
        f, Layout(checkpointing="full", checkpoint_blocks=("b.0", "b.2")), batch=256, world_size=2
    )
    assert full.parts["activations"] == pytest.approx(256 * (0.4 + 2) * MiB)
    assert half.parts["activations"] == pytest.approx(256 * (2 * 1 + 2 * 0.1 + 2) * MiB)
    assert named.parts["activations"] == half.parts["activations"]
    acc = predict(f, Layout(sharding="fsdp"), batch=64, accumulation=2, world_size=2)
    one = predict(f, Layout(sharding="fsdp"), batch=64, world_size=2)
    assert acc.parts["gradients"] == 50 * MiB and one.parts.get("gradients", 0) == 0
    assert acc.peak_bytes - one.peak_bytes == pytest.approx(50 * MiB)


def test_offload_moves_shards_to_the_host_on_a_gpu_and_not_on_a_cpu():
    f = _facts()
    layout = Layout(sharding="fsdp", cpu_offload=True)
    gpu = predict(f, layout, batch=8, world_size=2, device_type="cuda")
    cpu = predict(f, layout, batch=8, world_size=2, device_type="cpu")
    assert "optimizer" not in gpu.parts and gpu.host_bytes == (50 + 100 + 50 + 25) * MiB
    assert cpu.host_bytes == 0 and cpu.peak_bytes > gpu.peak_bytes


def test_calibration_reproduces_the_measured_peak_and_carries_the_difference():
    f = _facts()
    modelled = predict(f, Layout(), batch=8, world_size=2).peak_bytes
    raw = predict(f, Layout(sharding="fsdp"), batch=8, world_size=2)
    # Missed bytes (a workspace) are added as they are ...
    more = calibrate(f, Layout(), modelled + 50 * MiB, batch=8, world_size=2)
    assert predict(
        f, Layout(), batch=8, world_size=2, calibration=more
    ).peak_bytes == pytest.approx(modelled + 50 * MiB)
    other = predict(f, Layout(sharding="fsdp"), batch=8, world_size=2, calibration=more)
    assert other.parts["calibration"] == 50 * MiB
    assert other.peak_bytes == pytest.approx(raw.peak_bytes + 50 * MiB)
    # ... an excess of the model is taken off in proportion.
    less = calibrate(f, Layout(), modelled * 0.9, batch=8, world_size=2)
    assert predict(
        f, Layout(), batch=8, world_size=2, calibration=less
    ).peak_bytes == pytest.approx(modelled * 0.9)
    scaled = predict(f, Layout(sharding="fsdp"), batch=8, world_size=2, calibration=less)
    assert scaled.peak_bytes == pytest.approx(raw.peak_bytes * 0.9)
    assert "at the backward peak" in other.describe()


def test_facts_of_the_tiny_gpt_are_measured_per_block_and_policy():
    w = tiny_gpt_workload()
    f = measure_memory_facts(w)
    params = sum(p.numel() * p.element_size() for p in w.model().parameters())
    assert f.param_bytes == params and f.method == "cpu-profiler"
    assert f.optimizer_bytes == pytest.approx(2 * params, rel=0.01)  # AdamW's two moments
    assert [b.name for b in f.blocks] == ["blocks.0", "blocks.1"]
    for b in f.blocks:
        at = {p: b.kept[p].at(w.batch_size) for p in b.kept}
        assert 0 < at["full"] < at["selective"] < at["none"]
    assert MemoryFacts.from_dict(f.to_dict()) == f


def test_prepare_shards_a_users_model_and_rebuilds_its_optimizer_over_the_shards():
    from tunekit import prepare
    from tunekit.testing import assert_states_close
    from tunekit.testing.fixtures import TINY_GPT

    def trained(**layout):
        with default_dtype(torch.float64):
            w = tiny_gpt_workload()
            torch.manual_seed(0)
            model = w.model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
            model, opt, step = prepare(model, optimizer, w.loss, None, batch_size=4, **layout)
            for i in range(3):
                step(*w.example_batch(4, seed=i))
            if layout:
                from torch.distributed.checkpoint.state_dict import (
                    StateDictOptions,
                    get_model_state_dict,
                )

                assert type(opt) is torch.optim.AdamW and opt is not optimizer
                assert opt.param_groups[0]["weight_decay"] == 0.1 and step.session.checkpointed
                return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            return model.state_dict()

    with single_rank_group():
        plain = trained()
        sharded = trained(sharding="fsdp", checkpointing="full")
    assert set(plain) == set(sharded) and len(plain) == 3 + 12 * TINY_GPT["blocks"] + 2
    assert_states_close(sharded, plain, "prepare(sharding='fsdp')")
