"""Helpers for testing tuners and tunekit itself, with real components.

For plugin authors (see ``docs/plugins.md``, "Testing"):

* :func:`tiny_workload`, :func:`tiny_dataset_workload` — real
  :class:`~tunekit.workload.Workload` objects (a batch factory and a dataset
  variant) that train in milliseconds; also usable by name,
  ``tunekit.testing:tiny_workload``;
* :func:`tiny_hardware` — a deterministic :class:`~tunekit.hardware.Hardware`
  (``local_hardware`` describes this machine instead);
* :func:`synthetic_observation` — an :class:`~tunekit.observe.observation.Observation`
  as the orchestrator builds it (model summary, graph, baseline measurement,
  step breakdown, telemetry summarised by the real summarisers), with the
  numbers you choose;
* :func:`tiny_gpt_workload`, :func:`tiny_vit_workload` — toy transformers
  trained as ``example:gpt`` and ``example:vit`` are (AdamW, a warm-up + cosine
  schedule, clipping): for tuners of transformer blocks, and for hooks that must
  honour a schedule;
* :func:`check_conformance` — the contract, checked phase by phase: knobs
  declared with types and ranges, ``diagnose`` and ``plan`` return what the
  orchestrator needs, the runtime hook applies on a real
  :class:`~tunekit.runtime.session.Session`, is undone by ``session.reset()``
  and leaks nothing into the next trial, and every knob not marked
  ``changes_math`` trains, in float64 on 1 and 2 ranks, what the untuned job
  trains (:func:`check_equivalence`). Failures raise
  :class:`ConformanceError` (an ``AssertionError``) naming the plugin and
  every problem found, with the traceback of anything the plugin raised.

For multi-process tests, :func:`run_ranks` runs a function on N real
processes joined in a gloo process group on loopback, the way torchrun would,
and returns what each rank returned (equivalence tests: a gradient reducer
against DDP, a placement against single-process training). Equivalence tests
run in float64 (``run_ranks(..., dtype=torch.float64)``, :func:`default_dtype`
for the reference run) and compare with :func:`assert_states_close`: float
summation order then costs ~1e-15, so a tight tolerance holds on any CPU and
still catches a real mistake.

The helpers live in modules by concern; import them from here:

* :mod:`~tunekit.testing.ranks` — :func:`run_ranks`, :func:`single_rank_group`
  and the float64 equivalence check;
* :mod:`~tunekit.testing.fixtures` — tiny workloads (an MLP, toy GPT and ViT),
  :func:`tiny_hardware`, :func:`local_hardware`, :class:`MemoryCache`;
* :mod:`~tunekit.testing.synthetic` — :func:`synthetic_breakdown`,
  :func:`synthetic_telemetry`, :func:`synthetic_observation`;
* :mod:`~tunekit.testing.snapshots` — :func:`snapshot_session`,
  :func:`compare_states`: a session's state before and after a hook;
* :mod:`~tunekit.testing.conformance` — :func:`check_conformance` and its phases;
* :mod:`~tunekit.testing.equivalence` — the float64 runs against the untuned job.
"""

# The names marked noqa are as public as the rest (tests and plugins import them) but
# were never in __all__: a star import brings what it brought before the split.
from tunekit.runtime.dist import single_rank_group  # noqa: F401  (lives in the runtime)
from tunekit.testing.conformance import (
    ConformanceError,
    ConformanceReport,
    check_conformance,
    check_declaration,
    check_diagnose_and_plan,
    check_equivalence,
    check_runtime,
)
from tunekit.testing.equivalence import EQUIVALENCE_STEPS, EquivalenceCheck, equivalence_cases
from tunekit.testing.fixtures import (
    TINY_CLASSES,  # noqa: F401
    TINY_FEATURES,  # noqa: F401
    TINY_GPT,  # noqa: F401
    TINY_VIT,  # noqa: F401
    MemoryCache,
    TinyDataset,
    local_hardware,
    tiny_dataset_workload,
    tiny_gpt_workload,
    tiny_hardware,
    tiny_vit_workload,
    tiny_workload,
)
from tunekit.testing.ranks import (
    EQUIVALENCE_RTOL,  # noqa: F401
    RANK_THREADS_ENV,  # noqa: F401
    assert_states_close,
    default_dtype,
    rank_threads,  # noqa: F401
    run_ranks,
)
from tunekit.testing.snapshots import (
    SINGLETON_THREADS,  # noqa: F401
    SessionState,
    compare_states,  # noqa: F401
    snapshot_session,
    torch_flags,  # noqa: F401
)
from tunekit.testing.synthetic import (
    DEFAULT_FRACTIONS,  # noqa: F401
    synthetic_breakdown,
    synthetic_observation,
    synthetic_telemetry,
)

__all__ = [
    "EQUIVALENCE_STEPS",
    "ConformanceError",
    "ConformanceReport",
    "EquivalenceCheck",
    "MemoryCache",
    "SessionState",
    "TinyDataset",
    "assert_states_close",
    "check_conformance",
    "check_declaration",
    "check_diagnose_and_plan",
    "check_equivalence",
    "check_runtime",
    "default_dtype",
    "equivalence_cases",
    "local_hardware",
    "run_ranks",
    "snapshot_session",
    "synthetic_breakdown",
    "synthetic_observation",
    "synthetic_telemetry",
    "tiny_dataset_workload",
    "tiny_gpt_workload",
    "tiny_hardware",
    "tiny_vit_workload",
    "tiny_workload",
]
