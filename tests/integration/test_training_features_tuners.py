"""Issue 17, item 2: every tuner's math-preserving configs honour the workload's training
features (gradient accumulation, an LR scheduler, clipping by global norm, bf16 autocast,
fp16 with a GradScaler) and end where plain DDP ends; a feature a config cannot honour is
refused in one line at install and said by the tuner's diagnosis ("does not apply: ...").

float64 for accumulation, the scheduler and clipping (the same mathematics: EQUIVALENCE_RTOL).
Autocast does not touch float64, so bf16/fp16 run in float32 against DDP under the same
autocast, with AUTOCAST_RTOL: the gradient reductions' float32 summation order changes a
parameter by ~1e-7, which a later bf16 rounding of that parameter can turn into one bf16
ulp (2**-8) of one activation; a missed feature moves parameters far more (a skipped
clip by the clip ratio, a wrong lr by the lr)."""

from __future__ import annotations

import pytest
import torch
from tuner_features_ranks import refused_many, train, train_many

from tunekit.testing import EQUIVALENCE_RTOL, assert_states_close, default_dtype, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.equivalence]

F64 = torch.float64
STEPS = 4
EXACT = ["accum", "sched", "clip", "all"]
AUTOCAST_RTOL = {"bf16": 2e-2, "fp16": 1e-3}
"""float32 under autocast against DDP under the same autocast (see above). Without autocast
the MLP ends ~1e-1 (bf16) / ~1e-4 (fp16) away; fp16's runs are also compared on the
GradScaler's final scale, exactly, after steps it skipped."""


def _runs(how: str, knobs: dict, variants: list[str], ddp: bool = True) -> list[tuple]:
    runs = []
    for v in variants:
        if ddp:
            runs.append((v, "ddp", {}, STEPS))
        runs.append((v, how, knobs, STEPS))
    return runs


def _check_pairs(
    results: list[dict],
    variants: list[str],
    what: str,
    autocast: bool = False,
    global_loss: bool = False,
) -> None:
    for r, rank in enumerate(results):
        for i, v in enumerate(variants):
            ddp, tuned = rank[2 * i], rank[2 * i + 1]
            if global_loss:  # the tuner reports the global batch's loss, DDP each rank's own
                per_rank = [q[2 * i]["losses"] for q in results]
                ddp = {**ddp, "losses": [sum(x) / len(x) for x in zip(*per_rank, strict=True)]}
            _close(tuned, ddp, f"rank {r} {what} {v}", AUTOCAST_RTOL.get(v) if autocast else None)
            if v == "fp16":  # the scaler skipped the overflowing steps and backed off alike
                assert ddp["scale"] < 2.0**22 and tuned["scale"] == ddp["scale"], (
                    ddp["scale"],
                    tuned["scale"],
                )
            if v in ("clip", "all"):  # the clip really clipped, every step
                assert len(ddp["norms"]) == STEPS and min(ddp["norms"]) > 0.05, ddp["norms"]


def _close(tuned: dict, ref: dict, what: str, rtol: float | None) -> None:
    if rtol is None:
        assert_states_close(tuned["params"], ref["params"], what)
        assert tuned["losses"] == pytest.approx(ref["losses"], rel=EQUIVALENCE_RTOL)
        assert tuned["lr"] == pytest.approx(ref["lr"], rel=EQUIVALENCE_RTOL), f"{what}: lr"
    else:
        for name, p in ref["params"].items():
            scale = float(p.abs().max())
            torch.testing.assert_close(
                tuned["params"][name],
                p,
                rtol=rtol,
                atol=rtol * scale,
                msg=lambda m, n=name: f"{what} {n}: {m}",
            )
        assert tuned["losses"] == pytest.approx(ref["losses"], rel=rtol)


def test_two_chunk_without_replicated_layers_honours_every_feature():
    knobs = {"k": 2, "f": 0}
    exact = run_ranks(train_many, 2, (_runs("two_chunk", knobs, EXACT),), dtype=F64)
    _check_pairs(exact, EXACT, "two_chunk k=2 f=0")
    amp = run_ranks(train_many, 2, (_runs("two_chunk", knobs, ["bf16", "fp16"]),))
    _check_pairs(amp, ["bf16", "fp16"], "two_chunk k=2 f=0", autocast=True)


def test_two_chunk_takes_a_tied_head_by_either_name():
    # k=1: chunk 1 is the head, whose weight is the first layer's (as example:gpt's head)
    res = run_ranks(train_many, 2, (_runs("two_chunk", {"k": 1, "f": 0}, ["tied_all"]),), dtype=F64)
    _check_pairs(res, ["tied_all"], "two_chunk k=1 f=0, tied head")


def test_cgdp_honours_every_feature_and_offload_all_but_the_scaler():
    runs = _runs("cgdp", {"chunk_size": 1}, EXACT) + [
        ("all", "cgdp", {"chunk_size": 2, "offload_optimizer": True}, STEPS),
    ]
    res = run_ranks(train_many, 2, (runs,), dtype=F64)
    _check_pairs([r[: 2 * len(EXACT)] for r in res], EXACT, "cgdp k=1")
    for rank in res:
        _close(rank[-1], rank[2 * EXACT.index("all")], "cgdp offload, all features", None)
    amp = run_ranks(train_many, 2, (_runs("cgdp", {"chunk_size": 2}, ["bf16", "fp16"]),))
    _check_pairs(amp, ["bf16", "fp16"], "cgdp k=2", autocast=True)


def _local(variant: str, dtype: torch.dtype | None) -> dict:
    """One process, one replica (the session's LocalSync): what a 1 x 2 hybrid must match."""
    from tunekit.testing import single_rank_group

    with single_rank_group():
        if dtype is None:
            return train(variant, "ddp", {}, STEPS)
        with default_dtype(dtype):
            return train(variant, "ddp", {}, STEPS)


def test_hybrid_mp_two_devices_honours_every_feature():
    runs = [(v, "hybrid_mp", {}, STEPS) for v in EXACT]
    res = run_ranks(train_many, 2, (runs,), dtype=F64)
    for v, *ranks in zip(EXACT, *res, strict=True):
        ref = _local(v, F64)
        if v in ("clip", "all"):
            assert min(ref["norms"]) > 0.05
        for r, tuned in enumerate(ranks):
            _close(tuned, ref, f"rank {r} hybrid_mp {v}", None)
    amp = ["bf16", "fp16"]
    res = run_ranks(train_many, 2, ([(v, "hybrid_mp", {}, STEPS) for v in amp],))
    for v, *ranks in zip(amp, *res, strict=True):
        ref = _local(v, None)
        for r, tuned in enumerate(ranks):
            _close(tuned, ref, f"rank {r} hybrid_mp {v}", AUTOCAST_RTOL[v])
            # fp16: both ranks skipped the overflowing steps with the one replica
            assert tuned["scale"] == ref["scale"], (v, tuned["scale"], ref["scale"])
        if v == "fp16":
            assert ref["scale"] < 2.0**22


def test_layer_split_honours_accumulation_scheduler_and_clipping():
    res = run_ranks(train_many, 2, (_runs("layer_split", {"plan": "owt"}, EXACT),), dtype=F64)
    _check_pairs(res, EXACT, "layer_split owt", global_loss=True)


def test_batch_ps_sizing_trades_micro_batches_for_accumulation_with_the_same_updates():
    # 4 micro-batches of 4 against 1 of 16 and 2 of 8: every step trains the same 32 samples
    # (ranks share them differently, the mean gradient is the same), so DDP ends alike.
    trades = [{"batch_size": 16, "accumulation": 1}, {"batch_size": 8, "accumulation": 2}]
    control = {"batch_size": 8, "accumulation": 1}  # half the samples per step: not the same
    runs = [("mlp_data_accum", "ddp", {}, STEPS)] + [
        ("mlp_data_accum", "batch_ps_sizing", knobs, STEPS) for knobs in [*trades, control]
    ]
    res = run_ranks(train_many, 2, (runs,), dtype=F64)
    for r, (ref, *tuned, other) in enumerate(res):
        with pytest.raises(AssertionError):  # the comparison tells different updates apart
            assert_states_close(other["params"], ref["params"], f"rank {r} {control}")
        for knobs, t in zip(trades, tuned, strict=True):
            assert_states_close(t["params"], ref["params"], f"rank {r} {knobs}")
            assert t["lr"] == pytest.approx(ref["lr"], rel=EQUIVALENCE_RTOL)
    # the global loss of each step: each rank's mean, averaged over the ranks
    means = [[sum(x) / 2 for x in zip(res[0][i]["losses"], res[1][i]["losses"], strict=True)]
             for i in range(len(runs))]  # fmt: skip
    for i in (1, 2):
        assert means[i] == pytest.approx(means[0], rel=1e-9)


REFUSED = [
    ("clip", "two_chunk", {"k": 2, "f": 1}, "clipping"),
    ("accum", "two_chunk", {"k": 2, "f": 1}, "accumulation"),
    ("sched", "two_chunk", {"k": 2, "f": 1}, "scheduler"),
    ("bf16", "two_chunk", {"k": 2, "f": 1}, "amp"),
    ("fp16", "cgdp", {"chunk_size": 1, "offload_optimizer": True}, "grad_scaler"),
    ("bf16", "layer_split", {"plan": "owt"}, "amp"),
]


def test_a_feature_a_config_cannot_honour_is_refused_in_one_line():
    out = run_ranks(refused_many, 2, ([c[:3] for c in REFUSED],))
    for lines in out:
        for (variant, how, _knobs, feature), line in zip(REFUSED, lines, strict=True):
            assert line.startswith("ConfigError") and f"does not honour {feature}" in line, (
                variant,
                how,
                line,
            )
            assert "\n" not in line
