"""The public surface, frozen: plugins and scripts depend on it, so it changes only on purpose.

What is frozen: the entry-point group, the tuner API version, the contract's
hooks (names, parameters, which are required), its data types' fields and
values, the plugin statuses, and every CLI command with its arguments and
options. A deliberate change updates the literal here (and CHANGELOG.md; a
breaking change to the contract bumps API_VERSION's major).

To update CLI_SURFACE after adding or changing a command, run

    .venv/bin/python tests/unit/test_public_surface.py

and paste its output over the literal below (the ``tui`` command, when the TUI
registers it, is such an addition).
"""

import dataclasses
import inspect
import subprocess
import sys
import typing
from importlib.metadata import entry_points
from pathlib import Path

import click
import tomllib

from tunekit import API_VERSION
from tunekit.cli.main import SUMMARIES, cli
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, SearchResult, Tuner
from tunekit.plugin_loading import FAILED, GROUP, INCOMPATIBLE, INVALID, OK

ROOT = Path(__file__).resolve().parents[2]

# -- plugins ------------------------------------------------------------------------------------

ENTRY_POINT_GROUP = "tunekit.plugins"
FROZEN_API_VERSION = (1, 0)

HOOKS = {
    # hook: (parameters, required)
    "knobs": (("self",), True),
    "diagnose": (("self", "obs"), True),
    "plan": (("self", "obs", "limit"), True),
    "apply": (("self", "session", "knobs"), True),
    "search": (("self", "session", "knobs", "max_steps"), False),
    "snippet": (("self", "knobs"), False),
    "explain": (("self", "candidate"), False),
    "layout": (("self", "knobs"), False),
}
TUNER_ATTRIBUTES = ("name", "title", "aspect", "excludes", "api_version")
ASPECTS = ("batch", "placement", "grad_sync", "data", "layout")
FIELDS = {
    Knob: (
        "name",
        "type",
        "default",
        "help",
        "low",
        "high",
        "choices",
        "changes_math",
        "live",
        "parse",
    ),
    Diagnosis: ("applies", "summary", "expected_gain", "details", "headline"),
    Candidate: (
        "knobs",
        "predicted_step_s",
        "rationale",
        "details",
        "predicted_range_s",
        "global_batch",
        "predicted_peak_bytes",
        "combined_with",
        "search",
    ),
    SearchResult: ("knobs", "trace", "summary", "details"),
}
KNOB_TYPES = ("int", "float", "bool", "choice", "str")
KNOB_LIVE = ("step", "relaunch")
STATUSES = ("ok", "failed", "incompatible", "invalid")


def test_the_entry_point_group_is_frozen_and_is_where_the_built_ins_register():
    assert GROUP == ENTRY_POINT_GROUP
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    builtins = set(pyproject["project"]["entry-points"][ENTRY_POINT_GROUP])
    assert builtins == {
        "batch_ps_sizing",
        "cgdp",
        "hybrid_mp",
        "layer_split",
        "overlap_chunking",
        "sharding",
    }
    assert builtins <= {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}


def test_the_api_version_is_frozen():
    assert API_VERSION == FROZEN_API_VERSION
    assert Tuner.api_version == FROZEN_API_VERSION[0]


def test_the_tuner_hooks_are_frozen():
    hooks = {
        name
        for name, member in vars(Tuner).items()
        if callable(member) and not name.startswith("_")
    }
    helpers = {"knob_map", "validate", "defaults"}
    assert hooks - helpers == set(HOOKS)
    for name, (params, required) in HOOKS.items():
        assert tuple(inspect.signature(getattr(Tuner, name)).parameters) == params, name
        assert (name in Tuner.__abstractmethods__) == required, name
    for attr in TUNER_ATTRIBUTES:
        assert attr in Tuner.__annotations__, attr


def test_the_contract_types_are_frozen():
    assert tuple(a.value for a in Aspect) == ASPECTS
    for cls, fields in FIELDS.items():
        assert tuple(f.name for f in dataclasses.fields(cls)) == fields, cls.__name__
    hints = typing.get_type_hints(Knob)
    assert typing.get_args(hints["type"]) == KNOB_TYPES
    assert typing.get_args(hints["live"]) == KNOB_LIVE
    assert (OK, FAILED, INCOMPATIBLE, INVALID) == STATUSES


# -- the plugin API (tunekit.api) ----------------------------------------------------------------

# What plugins may import besides the contract and the errors (tests/unit/test_layout.py keeps
# the built-in plugins to it). Adding a name is a minor change; removing or renaming one breaks
# third-party plugins.
API_NAMES = (
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
)
OBSERVATION_FIELDS = (
    "workload_spec",
    "workload",
    "nproc",
    "backend",
    "device_type",
    "hardware",
    "model",
    "baseline",
    "graph",
    "layer_profile",
    "breakdown",
    "telemetry",
    "cache",
    "memory",
    "memory_cap_bytes",
    "baseline_peak_bytes",
    "blocks",
    "extra",
)
OBSERVATION_METHODS = {
    "predict_memory": ("self", "layout", "batch", "accumulation"),
    "memo": ("self", "key", "fn"),
    "cached": ("self", "key", "fn", "encode", "decode"),
}


def test_the_plugin_api_is_frozen_and_typed():
    import tunekit.api as api
    from tunekit.api import Observation

    assert tuple(api.__all__) == API_NAMES
    missing = [n for n in API_NAMES if not hasattr(api, n)]
    assert not missing, missing
    public = [f.name for f in dataclasses.fields(Observation) if not f.name.startswith("_")]
    assert tuple(public) == OBSERVATION_FIELDS
    for name, params in OBSERVATION_METHODS.items():
        assert tuple(inspect.signature(getattr(Observation, name)).parameters) == params, name
    # Every field has a real type (no Any): plugins read them without duck typing.
    hints = typing.get_type_hints(Observation, localns=vars(api))  # TYPE_CHECKING imports
    untyped = [
        n
        for n in OBSERVATION_FIELDS
        if n != "extra" and typing.Any in (hints[n], *typing.get_args(hints[n]))
    ]
    assert not untyped, untyped


# -- the CLI ------------------------------------------------------------------------------------

ROOT_OPTIONS = ["--version", "-h/--help"]
CLI_SURFACE = {
    "apply": ["RUN", "CONFIG", "--nproc", "--watch", "--no-wait", "--store"],
    "auto": [
        "WORKLOAD",
        "--nproc",
        "--plugins",
        "--trials",
        "--budget",
        "--out",
        "--store",
        "--resume",
        "--steps",
        "--warmup",
        "--timeout",
        "--stall",
        "--measure-rounds",
        "--min-effect",
        "--device",
        "--hardware",
        "--nnodes",
        "--node-rank",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--token-file",
        "--join-timeout",
        "--loopback-nodes",
        "--json",
        "--apply",
        "--keep-running",
        "--no-probe",
        "--no-rerank",
        "-v/--explain",
        "--search-steps",
        "--memory-cap",
    ],
    "follow": [
        "--coordinator/--rdzv-endpoint",
        "--node-rank",
        "--token-file",
        "--store",
        "--join-timeout",
    ],
    "hardware": [],
    "hardware list": [],
    "hardware probe": ["--nproc", "--repeats", "--save", "--store", "--no-store"],
    "hardware show": ["PROFILE", "--nproc", "--device", "--store"],
    "new-plugin": ["NAME", "--dir"],
    "plan": [
        "PLUGIN",
        "WORKLOAD",
        "--nproc",
        "--hardware",
        "--limit",
        "--out",
        "--json",
        "--always-plan",
        "--timeout",
        "-v/--explain",
        "--store",
        "--memory-cap",
    ],
    "plugins": ["--knobs"],
    "profile": [
        "WORKLOAD",
        "--nproc",
        "--steps",
        "--warmup",
        "--out",
        "--device",
        "--top",
        "--timeout",
    ],
    "report": ["STUDY", "--store", "--out", "--json", "--list"],
    "rollback": ["RUN", "--store"],
    "run": [
        "WORKLOAD",
        "--nproc",
        "--config",
        "--steps",
        "--checkpoint-every",
        "--watch-window",
        "--min-effect",
        "--resume",
        "--name",
        "--device",
        "--nnodes",
        "--node-rank",
        "--rdzv-endpoint",
        "--token-file",
        "--join-timeout",
        "--store",
        "--memory-cap",
    ],
    "status": ["RUN", "--json", "--store"],
    "stop": ["RUN", "--store"],
    "trial": ["RUN", "CONFIG", "--window", "--store"],
    "tui": [
        "WORKLOAD",
        "--attach",
        "--nproc",
        "--plugins",
        "--trials",
        "--steps",
        "--warmup",
        "--watch-window",
        "--min-effect",
        "--device",
        "--store",
        "--memory-cap",
    ],
}


def cli_surface(command: click.Command = cli, path: str = "") -> dict[str, list[str]]:
    """Every (sub)command -> its arguments (upper case) and options, in declaration order."""
    out: dict[str, list[str]] = {}
    ctx = click.Context(command)
    names = command.list_commands(ctx) if isinstance(command, click.Group) else []
    for name in sorted(names):
        sub = command.get_command(ctx, name)
        key = f"{path} {name}".strip()
        out[key] = [
            p.name.upper() if isinstance(p, click.Argument) else "/".join(p.opts + p.secondary_opts)
            for p in sub.params
        ]
        out.update(cli_surface(sub, key))
    return out


def print_cli_surface() -> None:
    """Print the current CLI surface as the literal to paste into CLI_SURFACE."""
    print("CLI_SURFACE = {")
    for key, params in cli_surface().items():
        print(f"    {key!r}: {params!r},")
    print("}")


def test_every_cli_command_and_option_is_frozen():
    current = cli_surface()
    added = sorted(set(current) - set(CLI_SURFACE))
    removed = sorted(set(CLI_SURFACE) - set(current))
    assert not added and not removed, (
        f"commands added {added}, removed {removed}; if deliberate, update CLI_SURFACE "
        "(print_cli_surface() prints it) and CHANGELOG.md"
    )
    for key, params in CLI_SURFACE.items():
        assert current[key] == params, (
            f"`tunekit {key}` takes {current[key]}, frozen as {params}; if deliberate, update "
            "CLI_SURFACE and CHANGELOG.md"
        )
    ctx = click.Context(cli, **cli.context_settings)
    assert ["/".join(p.opts + p.secondary_opts) for p in cli.get_params(ctx)] == ROOT_OPTIONS


def test_the_command_list_shows_each_commands_own_summary_without_importing_it():
    ctx = click.Context(cli, **cli.context_settings)
    for name, summary in SUMMARIES.items():
        assert cli.get_command(ctx, name).get_short_help_str(10**4) == summary, name
    # `tunekit --help` in a fresh interpreter loads no command module, hence no torch.
    code = (
        "import sys; from tunekit.cli.main import main; main(['--help']); "
        "print('torch' in sys.modules, any(m.startswith('tunekit.cli.run') for m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = res.stdout.splitlines()
    assert lines[-1] == "False False"
    assert any(line.split()[:1] == ["report"] for line in lines)


if __name__ == "__main__":
    print_cli_surface()
