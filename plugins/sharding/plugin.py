"""sharding: the fastest layout that fits the memory bound.

FSDP or DDP, resharding after forward, activation checkpointing (policy and which
blocks), CPU offload, and the split of each rank's samples per step into micro-batches —
every combination predicted (step time relative to the measured baseline, peak memory per
rank from the core memory model) and only those that fit proposed, fastest first. The
layout is the core's to apply (the ``layout`` hook); micro-batches are this tuner's
runtime hook; checkpointing and micro-batches are searched inside one trial where the
build layout allows. See ``docs/tuners/sharding.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunekit.api import PART_WORDS, Observation, Session, compose_headline, format_bytes
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, SearchResult, Tuner
from tunekit.plugins.sharding.analysis import Analysis, analyse
from tunekit.plugins.sharding.knobs import declare, knobs_of, layout_changes
from tunekit.plugins.sharding.runtime import apply_micro_batches
from tunekit.plugins.sharding.search import (
    MIN_GAIN,
    Proposal,
    Variant,
    fits,
    format_variants,
    parse_variants,
    search_in_job,
)

STEP_WORDS = {
    "compute": "compute (with recomputation)",
    "comm_exposed": "exposed communication",
    "optimizer": "optimizer",
    "other": "data loading and idle (as measured)",
}
BATCH_TUNER = "batch_ps_sizing"
"""The tuner whose larger batch a layout may let fit (named, never imported: a combined
candidate is dropped where it is not in use)."""


class Sharding(Tuner):
    name = "sharding"
    title = "Sharding, checkpointing and micro-batches under the memory bound"
    aspect = Aspect.LAYOUT
    excludes = frozenset({Aspect.PLACEMENT})
    """A placement runs its own training step, which neither shards nor checkpoints."""
    api_version = 1

    # -- declare ---------------------------------------------------------------------

    def knobs(self) -> list[Knob]:
        return declare()

    def layout(self, knobs: Mapping[str, Any]) -> Mapping[str, Any]:
        return layout_changes(knobs)

    # -- diagnose / plan ---------------------------------------------------------------

    def analysis(self, obs: Observation) -> Analysis:
        return obs.memo("sharding:analysis", lambda: analyse(obs))

    def diagnose(self, obs: Observation) -> Diagnosis:
        if obs.memory is None:
            return Diagnosis(
                False,
                "the model's memory could not be measured here, so no layout can be checked "
                "against the bound; nothing is proposed",
                headline=compose_headline(False, figure="the model's memory was not measured"),
            )
        a = self.analysis(obs)
        peak, bound = a.peak, a.bound
        measured = "measured" if a.measured_peak else "model"
        memory = a.base.memory
        fill = memory.describe(limit=4).split(": ", 1)[-1] if memory is not None else ""
        share = (peak or 0.0) / bound.bytes
        head = (
            f"{format_bytes(peak)} per rank at the peak ({measured}), {share:.0%} of "
            f"{bound.source} ({format_bytes(bound.bytes)}); what fills it (model, calibrated "
            f"on the peak): {fill}"
        )
        levers = "; ".join(lever.phrase() for lever in a.levers)
        best = a.best
        if best is None:
            verdict = (
                f"no layout predicted to fit beats the job as it runs "
                f"({a.base.setting.describe()}) by {MIN_GAIN:.0%} or more"
            )
            gain = 0.0
        else:
            gain = a.gain
            verdict = (
                f"fastest that fits: {best.setting.describe()}, predicted "
                f"{_ms(best.step_s)} per step ({_ms(best.range_s[0])}-{_ms(best.range_s[1])}), "
                f"{gain:.0%} more samples/s than the {_baseline_word(a)} {_ms(a.base.step_s)}, "
                f"peaking at "
                f"{format_bytes(best.peak_bytes)}"
            )
        over = sum(1 for p in a.predictions if p.peak_bytes and p.peak_bytes > bound.bytes)
        summary = f"{head}; {levers}; {verdict}" + (
            f"; {over} of {len(a.predictions)} settings are predicted over the bound and never tried"
            if over
            else ""
        )
        applies = best is not None
        figure = f"peak {format_bytes(peak)}, {share:.0%} of {_short(bound.source)}"
        if best is None:
            headline = compose_headline(False, figure=figure)
        else:  # the step's predicted range as a range of the gain
            low, high = sorted(a.gain_at(step) for step in best.range_s)
            figure += f" · {best.setting.layout.describe()}"
            headline = compose_headline(True, gain, (low, high), figure)
        return Diagnosis(
            applies,
            summary,
            expected_gain=gain if applies else None,
            details=_details(a),
            headline=headline,
        )

    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        if obs.memory is None:
            return []
        a = self.analysis(obs)
        return [_candidate(a, p) for p in a.proposals[:limit]]

    # -- runtime -----------------------------------------------------------------------

    def apply(self, session: Session, knobs: Mapping[str, Any]) -> None:
        apply_micro_batches(session, knobs)

    def search(
        self, session: Session, knobs: Mapping[str, Any], max_steps: int
    ) -> SearchResult | None:
        """Time the step-level variants the plan listed (``search`` knob), in turn, at step
        boundaries; keep the fastest."""
        variants = parse_variants(str(knobs.get("search", "")))
        if len(variants) < 2:  # nothing to choose between: the trial measures the start
            return None
        best, tried, reason = search_in_job(session, variants, max_steps)
        found = dict(knobs)
        found["search"] = ""
        if best is None:
            return SearchResult(found, [t.to_dict() for t in tried], f"kept the start; {reason}")
        found.update(best.knobs())
        measured = next(t for t in tried if t.variant == best and t.step_s is not None)
        return SearchResult(
            found,
            [t.to_dict() for t in tried],
            f"{_variant_words(best)}: {_ms(measured.step_s or 0.0)} per step, the fastest of "
            f"{sum(t.status == 'ok' for t in tried)} measured; {reason}",
            details={"variants": [t.to_dict() for t in tried]},
        )

    # -- reporting ---------------------------------------------------------------------

    def snippet(self, knobs: Mapping[str, Any]) -> str | None:
        changes = layout_changes(knobs)
        lines = []
        if changes.get("sharding") == "fsdp" or "reshard_after_forward" in changes:
            reshard = changes.get("reshard_after_forward", True)
            offload = ", offload_policy=CPUOffloadPolicy()" if changes.get("cpu_offload") else ""
            lines += [
                "from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard",
                "for block in model.blocks:  # each transformer block, then the root",
                f"    fully_shard(block, reshard_after_forward={reshard}{offload})",
                f"fully_shard(model{offload})  # before building the optimizer",
            ]
        elif changes.get("sharding") == "ddp":
            lines.append("model = DistributedDataParallel(model)  # replicated, no sharding")
        policy = changes.get("checkpointing")
        if policy in ("full", "selective"):
            which = (
                ", ".join(changes["checkpoint_blocks"])
                if changes.get("checkpoint_blocks")
                else f"every {changes.get('checkpoint_every', 1)}-th block"
            )
            lines += [
                f"# {policy} activation checkpointing of {which}:",
                "from torch.utils.checkpoint import checkpoint",
                "x = checkpoint(block, x, use_reentrant=False)  # in the model's forward"
                + (
                    " (selective: context_fn=create_selective_checkpoint_contexts(policy))"
                    if policy == "selective"
                    else ""
                ),
            ]
        elif policy == "none":
            lines.append("# no activation checkpointing: call the blocks directly")
        micro = int(knobs.get("micro_batches", 0) or 0)
        if micro:
            lines.append(
                f"# {micro} micro-batches per step: split each rank's batch in {micro}, "
                f"backward(loss / {micro}) on each, one optimizer step"
            )
        return "\n".join(lines) or None

    def explain(self, candidate: Candidate) -> str | None:
        p = candidate.details.get("prediction")
        if not p or not p.get("memory"):
            return None
        rows = ["| part | predicted |", "| --- | --- |"]
        rows += [f"| {STEP_WORDS.get(k, k)} | {_ms(v)} |" for k, v in p["parts"].items()]
        rows += [
            f"| memory: {PART_WORDS.get(k, k)} | {format_bytes(v)} |"
            for k, v in p["memory"]["parts"].items()
        ]
        rows.append(f"| peak per rank | {format_bytes(p['memory']['peak_bytes'])} |")
        variants = candidate.details.get("variants")
        if variants:
            rows.append(f"| in-job search | {', '.join(v['setting'] for v in variants)} |")
        return "\n".join(rows)


# -- words ------------------------------------------------------------------------------


def _candidate(a: Analysis, proposal: Proposal) -> Candidate:
    p = proposal.prediction
    base = a.model.base
    knobs = knobs_of(p.setting, base)
    details: dict[str, Any] = {"prediction": p.to_dict()}
    search = bool(proposal.variants)
    if search:
        variants = [Variant.of(v.setting) for v in proposal.variants]
        knobs["search"] = format_variants(variants)
        details["variants"] = [v.to_dict() for v in proposal.variants]
    memory = p.memory
    fill = memory.describe(limit=2).split(": ", 1)[-1] if memory is not None else ""
    combined_with: dict[str, dict[str, Any]] = {}
    global_batch = None
    change = f"{p.step_s / a.base.step_s - 1:+.0%}"
    if proposal.batch is not None:  # a larger batch that this layout lets fit
        combined_with = {BATCH_TUNER: {"batch_size": proposal.batch}}
        global_batch = p.setting.samples * a.model.model.world_size
        change = (
            f"{a.base.step_s / a.base.setting.samples / proposal.per_sample_s - 1:+.0%} samples/s "
            f"at batch {proposal.batch}/rank ({BATCH_TUNER}: the learning rate follows the "
            "workload's rule)"
        )
    rationale = (
        f"{p.setting.describe()}: predicted {_ms(p.step_s)} per step "
        f"({change} vs the {_baseline_word(a)} {_ms(a.base.step_s)}), "
        f"peak {format_bytes(p.peak_bytes)} per rank of {_short(a.bound.source)} "
        f"{format_bytes(a.bound.bytes)} ({fill})"
        + (
            f"; an in-job search then times {len(proposal.variants)} step-level variants"
            if search
            else ""
        )
    )
    return Candidate(
        knobs,
        predicted_step_s=p.step_s,
        rationale=rationale,
        details=details,
        predicted_range_s=p.range_s,
        predicted_peak_bytes=p.peak_bytes,
        global_batch=global_batch,
        combined_with=combined_with,
        search=search,
    )


def _details(a: Analysis) -> dict[str, Any]:
    return {
        "bound_bytes": a.bound.bytes,
        "bound": a.bound.source,
        "measured_peak_bytes": a.measured_peak,
        "memory": a.base.memory.to_dict() if a.base.memory is not None else None,
        "calibration": a.model.describe(),
        "notes": a.model.notes,
        "levers": [lever.to_dict() for lever in a.levers],
        "settings": len(a.predictions),
        "fitting": sum(1 for p in a.predictions if fits(p, a.bound.bytes, a.model.base)),
        "best": a.best.to_dict() if a.best is not None else None,
    }


def _variant_words(v: Variant) -> str:
    ckpt = "no checkpointing" if v.checkpointing == "none" else f"{v.checkpointing} checkpointing"
    if v.checkpointing != "none" and v.every != 1:
        ckpt += f" of every {v.every}th block"
    return f"{ckpt}, {v.micro_batches} micro-batch{'es' if v.micro_batches > 1 else ''}"


def _baseline_word(a: Analysis) -> str:
    return "measured" if a.model.obs.baseline is not None else "model's"


def _short(source: str) -> str:
    return {"the --memory-cap": "the cap", "device memory": "device memory"}.get(
        source, "host memory"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:,.2f} s"
