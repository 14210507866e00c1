"""The child process that runs a workload's code for tunekit outside its trials.

    python -m tunekit.observe.workload_child FAULT_REPORT

Started by :class:`tunekit.observe.workload_process.WorkloadProcess`. It reads
one JSON request per line on stdin and writes one JSON reply per line on the
stdout it was started with; everything the workload prints (to ``sys.stdout``
or straight to file descriptor 1 or 2) goes to its stderr, which the parent
keeps in a capped log. Requests, in the order the parent sends them:

* ``observe``: load the workload, build the model, trace it, try one training step's
  forward, loss and backward on the example batch, summarise it;
* ``profile_layers``: time every layer of that model;
* ``memory_facts``: measure what the memory model needs on a fresh copy of it;
* ``idle``: drop that model (the process then waits out the baseline trial);
* ``observation``: set up what tuners read (the parts of an ``Observation``);
* ``diagnose`` / ``plan``: run one tuner's hook on it.

Replies are ``{"ok": true, "result": ..., "cpu_s": ...}`` (the CPU seconds the request took,
for the study's timings) or ``{"ok": false, "error": ...}`` for an exception. JSON both ways, never pickle: a reply is plain data the
parent rebuilds (``ModelGraph.from_dict`` ...), and nothing the workload
defines crosses over.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunekit.errors import TunekitError
from tunekit.trials.exits import enable_fault_report, is_oom

if TYPE_CHECKING:  # imported where used: the child starts light
    from tunekit.observe.graph import ModelGraph
    from tunekit.observe.observation import Observation
    from tunekit.workload import Workload


class RecordingCache:
    """``obs.cache`` in the child: starts with the study's entries, returns what tuners put."""

    def __init__(self, entries: dict[str, Any]):
        self.entries = dict(entries)
        self.puts: dict[str, Any] = {}

    def get(self, key: str) -> Any:
        return self.entries.get(key)

    def put(self, key: str, value: Any) -> None:
        json.dumps(value)  # refuse what the store could not keep, here where the tuner can see it
        self.entries[key] = self.puts[key] = value

    def items(self) -> dict[str, Any]:
        return dict(self.entries)

    def take_puts(self) -> dict[str, Any]:
        puts, self.puts = self.puts, {}
        return puts


class _State:
    """What the child keeps between requests."""

    def __init__(self) -> None:
        self.workload: Workload | None = None
        self.spec = ""
        self.model: Any = None  # the observed nn.Module and its example input, until idle
        self.example: Any = None
        self.graph: ModelGraph | None = None
        self.obs: Observation | None = None
        self.cache: RecordingCache | None = None
        self.tuners: dict[str, Any] = {}

    def load(self, spec: str) -> Workload:
        from tunekit.workload import load_workload

        if self.workload is None or self.spec != spec:
            self.workload, self.spec = load_workload(spec), spec
        return self.workload

    def tuner(self, name: str):
        if name not in self.tuners:
            from tunekit.plugin_loading import load_named, select

            self.tuners[name] = select(load_named([name]), [name])[name]
        return self.tuners[name]


def observe(state: _State, req: dict[str, Any]) -> dict[str, Any]:
    from tunekit.errors import ConfigError, WorkloadError
    from tunekit.observe.first_step import try_first_step
    from tunekit.observe.graph import trace_model
    from tunekit.observe.observation import summarize_model
    from tunekit.observe.workload_process import workload_facts
    from tunekit.runtime.sharding import check_layout

    wl = state.load(req["workload"])
    state.model = wl.model()
    try:
        blocks = check_layout(state.model, wl.layout())
    except ConfigError as exc:
        raise WorkloadError(f"workload {wl.name!r}: {exc}") from None
    batch = wl.example_batch(wl.batch_size, seed=req.get("seed", 0))
    state.example = batch[0]
    # Traced first: a forward pass that fails is then a WorkloadError in one line ("cannot trace ...").
    state.graph = trace_model(state.model, state.example)
    try_first_step(wl, state.model, batch)  # a loss that cannot train fails here, not in a trial
    summary = summarize_model(state.model, state.example)
    return {
        "workload": workload_facts(wl),
        "summary": summary.to_dict(),
        "graph": state.graph.to_dict(),
        "graph_hash": state.graph.graph_hash(),
        "blocks": blocks,
    }


def memory_facts(state: _State, req: dict[str, Any]) -> dict[str, Any]:
    """What the memory model needs, measured on a fresh copy of the model (one process)."""
    import torch

    from tunekit.observe.memory_facts import measure_memory_facts

    wl = state.load(req["workload"])
    threads = req.get("threads")
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        facts = measure_memory_facts(wl, torch.device(req.get("device", "cpu")))
    except Exception as exc:  # the baseline trial reports the workload's own failure
        return {
            "memory": None,
            "notice": f"could not measure the model's memory ({type(exc).__name__}: {exc})",
        }
    finally:
        torch.set_num_threads(before)
    return {"memory": facts.to_dict(), "notice": None}


def profile_layers(state: _State, req: dict[str, Any]) -> dict[str, Any]:

    from tunekit.observe.layer_profile import profile_layers as profile

    if state.model is None:
        raise RuntimeError("profile_layers before observe")
    threads = req.get("threads")  # each rank's share of the cores (None: torch's own)
    try:
        result = profile(
            state.model,
            state.example,
            state.graph,
            device=req["device"],
            warmup=1,
            repeats=int(req.get("repeats", 3)),
            threads=int(threads) if threads else None,
            hardware_fingerprint=req.get("hardware_fingerprint", ""),
        )
    except Exception as exc:  # the workload's own code failed; the baseline trial reports it
        return {
            "layer_profile": None,
            "notice": f"could not time the model's layers ({type(exc).__name__}: "
            f"{exc}); tuners fall back to the whole-step measurements",
        }
    return {"layer_profile": result.to_dict(), "notice": None}


def idle(state: _State, req: dict[str, Any]) -> dict[str, Any]:
    """Drop the observed model before waiting (the baseline trial runs meanwhile): keep little."""
    import gc

    import torch

    state.model = state.example = state.graph = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {}


def observation(state: _State, req: dict[str, Any]) -> dict[str, Any]:
    """Rebuild the ``Observation`` tuners read from its parts (``parts`` in the request)."""
    from tunekit.hardware import Hardware
    from tunekit.memory import MemoryFacts
    from tunekit.observe.breakdown import Breakdown
    from tunekit.observe.graph import ModelGraph
    from tunekit.observe.layer_profile import LayerProfile
    from tunekit.observe.observation import Measurement, ModelSummary, Observation

    p = req["parts"]
    state.cache = RecordingCache(p.get("cache") or {})
    state.obs = Observation(
        workload_spec=p["workload_spec"],
        workload=state.load(p["workload_spec"]),
        nproc=p["nproc"],
        backend=p["backend"],
        device_type=p["device_type"],
        hardware=Hardware.from_dict(p["hardware"]),
        model=ModelSummary.from_dict(p["summary"]),
        baseline=Measurement(**p["baseline"]) if p.get("baseline") else None,
        graph=ModelGraph.from_dict(p["graph"]) if p.get("graph") else None,
        layer_profile=LayerProfile.from_dict(p["layer_profile"])
        if p.get("layer_profile")
        else None,
        breakdown=Breakdown.from_dict(p["breakdown"]) if p.get("breakdown") else None,
        telemetry=p.get("telemetry"),
        cache=state.cache,
        memory=MemoryFacts.from_dict(p["memory"]) if p.get("memory") else None,
        memory_cap_bytes=p.get("memory_cap_bytes"),
        baseline_peak_bytes=p.get("baseline_peak_bytes"),
        blocks=list(p.get("blocks") or []),
    )
    return {}


def diagnose(state: _State, req: dict[str, Any]) -> dict[str, Any]:
    diag = state.tuner(req["plugin"]).diagnose(_obs(state))
    return {"diagnosis": asdict(diag), "cache_puts": _puts(state)}


def plan(state: _State, req: dict[str, Any]) -> dict[str, Any]:
    candidates = state.tuner(req["plugin"]).plan(_obs(state), int(req["limit"]))
    return {"candidates": [asdict(c) for c in candidates], "cache_puts": _puts(state)}


def _obs(state: _State) -> Observation:
    if state.obs is None:
        raise RuntimeError("a tuner hook before the observation was set up")
    return state.obs


def _puts(state: _State) -> dict[str, Any]:
    """What the tuner hook just put in the cache."""
    assert state.cache is not None  # set up with state.obs, which _obs checked first
    return state.cache.take_puts()


HANDLERS = {
    "observe": observe,
    "profile_layers": profile_layers,
    "memory_facts": memory_facts,
    "idle": idle,
    "observation": observation,
    "diagnose": diagnose,
    "plan": plan,
}


def describe_error(exc: BaseException, owner: type | None = None) -> dict[str, Any]:
    """An exception as plain data: its type decides how the parent classifies it; its
    traceback and where it was raised (in ``owner``'s package, a plugin) go with it."""
    from tunekit.failures import Failure

    failure = Failure.of(exc, owner)
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "oom": is_oom(exc),
        "tunekit_error": type(exc).__name__ if isinstance(exc, TunekitError) else None,
        "where": failure.where,
        "traceback": failure.traceback,
    }


def serve(requests, replies) -> None:
    state = _State()
    for line in requests:
        req = json.loads(line)
        cpu = time.process_time()
        try:
            result = HANDLERS[req["op"]](state, req)
            reply = json.dumps({"ok": True, "result": result, "cpu_s": time.process_time() - cpu})
        except BaseException as exc:  # noqa: BLE001 - the workload's sys.exit() too: the parent classifies
            tuner = state.tuners.get(req.get("plugin", ""))
            error = describe_error(exc, type(tuner) if tuner is not None else None)
            if tuner is not None:  # into this process's log, beside what the plugin printed
                print(
                    f"plugin {req['plugin']}'s {req['op']} raised:\n{error['traceback']}",
                    file=sys.stderr,
                )
            reply = json.dumps({"ok": False, "error": error})
        replies.write(reply + "\n")
        replies.flush()


def main(argv: list[str]) -> int:
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # what the workload prints must not corrupt the replies
    if argv:
        enable_fault_report(Path(argv[0]))
    # Before the first request: the parent starts this process early so that these
    # imports (torch, most of all) overlap its own work.
    import tunekit.observe.graph
    import tunekit.observe.layer_profile
    import tunekit.observe.observation
    import tunekit.plugin_loading  # noqa: F401

    serve(sys.stdin.buffer, replies)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
