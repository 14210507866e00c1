"""What a tuner plugin may use besides the contract: one stable import path.

A plugin imports from three modules only: :mod:`tunekit.contract` (the hooks
and their data types), :mod:`tunekit.errors`, and this one. Everything here is
re-exported from where it lives in the core, so the core can move code without
breaking a plugin; ``tests/unit/test_public_surface.py`` freezes the list, and
``tests/unit/test_layout.py`` keeps the built-in plugins to these imports.

What there is, by the step of a tuner's life that needs it:

* **Reading the job** (``diagnose``, ``plan``): :class:`Observation` and what it
  holds (:class:`ModelSummary`, :class:`Measurement`, :class:`ModelGraph`,
  :class:`LayerProfile`, :class:`Breakdown`, :class:`StepTruth`,
  :class:`Hardware`, :class:`TelemetrySummary`, the study cache); block
  detection; the machine this process runs on.
* **Measuring here**: steps timed part by part (:func:`time_steps`), layers run
  standalone (:class:`LayerRunner`), gradient-ready times
  (:func:`time_groups`), links, collectives and host copies with intervals
  (:func:`allreduce_timings`, :func:`copy_timings`, :func:`fit_samples`); how
  many repeats and how long a budget the user's ``$TUNEKIT_MEASURE_EFFORT``
  allows (:func:`effort_repeats`, :func:`effort_seconds`, :func:`measure_effort`).
* **Cost models**: FLOPs to seconds (:class:`ComputeRate`), a model calibrated
  on the measured baseline (:class:`Calibration`), the fastest store-and-forward
  path over a graph of links (:func:`fastest_path`, as :meth:`Hardware.route`).
* **Saying it** (``diagnose``): :func:`compose_headline`, the one-line headline every
  tuner writes the same way (verdict · expected gain with its range · the measured figure).
* **Searching**: a MILP wrapper over HiGHS (:class:`MilpModel`) and variable
  elimination over a cost graph (:func:`solve_elimination`).
* **The runtime hooks** (``apply``, ``search``): :class:`Session`, the gradient
  synchronisers (:class:`GradSync`, :class:`DDPSync`, :class:`LocalSync`,
  :class:`FSDPSync`) and their communication record, the batch source and its loader
  options, and collective helpers.
* **Memory and layout**: :class:`Layout` (sharding, resharding, offload, activation
  checkpointing; a tuner's ``layout`` hook returns its fields), the model's blocks
  (:func:`model_blocks`), the core memory model (:func:`predict_memory`,
  :func:`calibrate_memory` on :class:`MemoryFacts`, giving a :class:`MemoryPrediction`
  with its parts; ``Observation.predict_memory`` calibrates on the measured baseline),
  measured peaks (:class:`PeakMeter`) and the out-of-memory a cap raises
  (:class:`MemoryCapExceeded`).
"""

from __future__ import annotations

from tunekit.costmodel import BACKWARD_FLOPS_RATIO, Calibration, ComputeRate, training_flops
from tunekit.diagnosis_text import compose_headline
from tunekit.effort import effort_repeats, effort_seconds, measure_effort
from tunekit.hardware import GB, CollectiveFit, Device, Hardware, Host, fastest_path
from tunekit.layout import Layout
from tunekit.memory import (
    PART_WORDS,
    MemoryCalibration,
    MemoryFacts,
    MemoryPrediction,
    format_bytes,
)
from tunekit.memory import calibrate as calibrate_memory
from tunekit.memory import predict as predict_memory
from tunekit.observe.blocks import block_units, graph_units, unit_starts
from tunekit.observe.breakdown import Breakdown
from tunekit.observe.grad_timing import Clock, time_groups
from tunekit.observe.graph import Layer, ModelGraph, layer_output, trace_model
from tunekit.observe.layer_modules import LayerModule, layer_modules
from tunekit.observe.layer_profile import (
    LayerProfile,
    LayerRunner,
    LayerStep,
    LayerTiming,
    measure_layer,
    output_member,
    run_steps,
    tensor_out,
    timing_clock,
)
from tunekit.observe.local import describe_local_machine
from tunekit.observe.memory import MemoryCapExceeded, PeakMeter
from tunekit.observe.observation import (
    LayerInfo,
    Measurement,
    ModelSummary,
    Observation,
    StudyCache,
    TelemetrySummary,
    summarize_model,
)
from tunekit.observe.step_timing import (
    StepTiming,
    check_threads,
    intra_op_threads,
    is_out_of_memory,
    release_memory,
    time_steps,
)
from tunekit.observe.timing import (
    Estimate,
    allreduce_timings,
    bandwidth_estimate,
    copy_timings,
    fit_samples,
    timed_rounds,
)
from tunekit.observe.truth import StepTruth
from tunekit.runtime.data import BatchSource, LoaderOptions, to_device
from tunekit.runtime.dist import broadcast_object, single_rank_group
from tunekit.runtime.session import Session
from tunekit.runtime.sharding import FSDPSync, model_blocks
from tunekit.runtime.sync import (
    ALL_FEATURES,
    LAYOUT_FEATURES,
    CommRecord,
    DDPSync,
    GradSync,
    HookedAccumulation,
    LocalSync,
    ddp_supports_bucket_list,
    declined_features,
    overlap_ratio,
)
from tunekit.search.elimination import CostGraph, EliminationStats
from tunekit.search.elimination import solve as solve_elimination
from tunekit.search.ilp import MilpModel, MilpSolution
from tunekit.workload import Workload

__all__ = [
    "ALL_FEATURES",
    "BACKWARD_FLOPS_RATIO",
    "GB",
    "LAYOUT_FEATURES",
    "PART_WORDS",
    "BatchSource",
    "Breakdown",
    "Calibration",
    "Clock",
    "CollectiveFit",
    "CommRecord",
    "ComputeRate",
    "CostGraph",
    "DDPSync",
    "Device",
    "EliminationStats",
    "Estimate",
    "FSDPSync",
    "GradSync",
    "Hardware",
    "HookedAccumulation",
    "Host",
    "Layer",
    "LayerInfo",
    "LayerModule",
    "LayerProfile",
    "LayerRunner",
    "LayerStep",
    "LayerTiming",
    "Layout",
    "LoaderOptions",
    "LocalSync",
    "Measurement",
    "MemoryCalibration",
    "MemoryCapExceeded",
    "MemoryFacts",
    "MemoryPrediction",
    "MilpModel",
    "MilpSolution",
    "ModelGraph",
    "ModelSummary",
    "Observation",
    "PeakMeter",
    "Session",
    "StepTiming",
    "StepTruth",
    "StudyCache",
    "TelemetrySummary",
    "Workload",
    "allreduce_timings",
    "bandwidth_estimate",
    "block_units",
    "broadcast_object",
    "calibrate_memory",
    "check_threads",
    "compose_headline",
    "copy_timings",
    "ddp_supports_bucket_list",
    "declined_features",
    "describe_local_machine",
    "effort_repeats",
    "effort_seconds",
    "fastest_path",
    "fit_samples",
    "format_bytes",
    "graph_units",
    "intra_op_threads",
    "is_out_of_memory",
    "layer_modules",
    "layer_output",
    "measure_effort",
    "measure_layer",
    "model_blocks",
    "output_member",
    "overlap_ratio",
    "predict_memory",
    "release_memory",
    "run_steps",
    "single_rank_group",
    "solve_elimination",
    "summarize_model",
    "tensor_out",
    "time_groups",
    "time_steps",
    "timed_rounds",
    "timing_clock",
    "to_device",
    "trace_model",
    "training_flops",
    "unit_starts",
]
