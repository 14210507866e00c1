"""dataloader: DataLoader worker processes and pinned memory, sized from where the step waits.

A worked third-party tuner (not from the papers behind the built-in tuners).
When the training process loads and augments its own batches, the step waits
for them; worker processes can prepare the next batches while the step
trains, if the rank has cores to run them. The evidence is the baseline's
step breakdown (the ``data`` part), else py-spy's share of stack samples in
data loading, else a batch timed here; the cost model (:mod:`.model`) prices
each worker count against the rank's cores.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunekit.api import Observation, Session
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner
from tunekit_dataloader.model import LoaderFacts, loader_facts, predicted_step_s
from tunekit_dataloader.runtime import apply_loader_options

MAX_WORKERS = 32
WORKER_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
MIN_GAIN = 0.02
"""Smallest predicted saving (a fraction of the step) worth trials."""


class DataLoaderTuner(Tuner):
    name = "dataloader"
    title = "DataLoader workers and pinned memory (example plugin)"
    aspect = Aspect.DATA
    api_version = 1
    """The tuner API's major version this plugin was written for."""

    def facts(self, obs: Observation) -> LoaderFacts:
        """The loader's facts, worked out once per observation: diagnose and plan share them."""
        return obs.memo("dataloader:facts", lambda: loader_facts(obs))

    # -- declare ---------------------------------------------------------------------------

    def knobs(self) -> list[Knob]:
        return [
            Knob(
                "num_workers",
                "int",
                0,
                "loader worker processes per rank (0: load in the training process)",
                low=0,
                high=MAX_WORKERS,
            ),
            Knob(
                "pin_memory",
                "bool",
                False,
                "page-locked batches: faster, asynchronous copies to the GPU (no effect on CPU ranks)",
            ),
            Knob(
                "prefetch_factor",
                "int",
                2,
                "batches each worker keeps ready (with workers only)",
                low=1,
                high=16,
            ),
        ]

    # -- diagnose / plan ---------------------------------------------------------------------

    def diagnose(self, obs: Observation) -> Diagnosis:
        if obs.workload.dataset is None:
            return Diagnosis(
                False,
                "batches come from the workload's make_batch in the training loop; "
                "there is no DataLoader to tune",
            )
        facts = self.facts(obs)
        evidence = (
            f"data loading is {facts.data_share:.0%} of the step ({facts.data_s * 1e3:.1f} of "
            f"{facts.step_s * 1e3:.1f} ms, {facts.source}"
            + (f"; py-spy: {', '.join(facts.flags)}" if facts.flags else "")
            + ")"
        )
        ranked = self.ranked(facts)
        if not ranked:
            why = (
                "each rank's cores are busy computing, so workers would only compete with training"
                if facts.busy >= facts.cores and facts.data_share >= MIN_GAIN
                else "too little to gain"
            )
            return Diagnosis(
                False, f"{evidence}; {why}", expected_gain=0.0, details=facts.to_dict()
            )
        best = ranked[0]
        gain = 1 - best.predicted_step_s / facts.step_s
        return Diagnosis(
            True,
            f"{evidence}; {best.knobs['num_workers']} loader worker(s) per rank should save ~{gain:.0%}",
            expected_gain=gain,
            details={**facts.to_dict(), "best": best.knobs},
        )

    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        if obs.workload.dataset is None:
            return []
        return self.ranked(self.facts(obs))[:limit]

    def ranked(self, facts: LoaderFacts) -> list[Candidate]:
        """Worker counts worth a trial, best predicted first.

        A count is kept only if the model expects it to beat every smaller
        count by 1% or more: more workers cost memory and start-up time.
        """
        pin = facts.device_type == "cuda"
        out: list[Candidate] = []
        best = facts.step_s * (1 - MIN_GAIN)
        for workers in WORKER_COUNTS:
            if workers > max(2 * facts.cores, 1):
                break
            step = predicted_step_s(facts, workers, pin)
            if step >= best:
                continue
            best = step * 0.99
            bound = max(
                ("training", facts.rest_s),
                ("workers", facts.data_s / workers),
                ("cores", (facts.busy * facts.rest_s + facts.data_s) / facts.cores),
                key=lambda b: b[1],
            )[0]
            out.append(
                Candidate(
                    {"num_workers": workers, "pin_memory": pin, "prefetch_factor": 2},
                    step,
                    f"{workers} worker(s)/rank{', pinned' if pin else ''}: "
                    f"{facts.data_s / workers * 1e3:.1f} ms of loading per batch per worker; "
                    f"bound by {bound}",
                    details={"bound": bound},
                )
            )
        return sorted(out, key=lambda c: c.predicted_step_s)

    # -- runtime ---------------------------------------------------------------------------

    def apply(self, session: Session, knobs: Mapping[str, Any]) -> None:
        apply_loader_options(session, knobs)

    def snippet(self, knobs: Mapping[str, Any]) -> str | None:
        workers = knobs["num_workers"]
        if workers == 0 and not knobs["pin_memory"]:
            return None
        extra = (
            f", prefetch_factor={knobs['prefetch_factor']}, persistent_workers=True"
            if workers
            else ""
        )
        return (
            "loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, "
            f"num_workers={workers}, pin_memory={knobs['pin_memory']}{extra})"
        )
