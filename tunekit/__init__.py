"""tunekit: a profiler-driven auto-tuner for distributed PyTorch training.

The core package never imports the TUI (``tunekit.tui``) or a plugin
(``tunekit.plugins.*``); plugins are found through entry points.
"""

import os

# torch.profiler's C++ side (kineto) prints USDT and CUPTI lines to stderr on
# every use, even on CPU-only machines; tunekit profiles often. Users who want
# them set KINETO_LOG_LEVEL themselves.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import warnings  # noqa: E402

# Profiling a fixed number of steps is deliberate; torch warns about it every time.
warnings.filterwarnings(
    "ignore", message=r"(?s).*Profiler clears events at the end of each cycle", category=UserWarning
)
warnings.filterwarnings("ignore", message=r"Profiler won't be using warmup", category=UserWarning)

__version__ = "0.1.0"

# The tuner contract's version: (major, minor). A plugin declares the major
# version it was built for; a different major is refused when it is loaded.
API_VERSION = (1, 0)

__all__ = ["API_VERSION", "Workload", "__version__", "load_workload", "prepare"]


def __getattr__(name: str):
    # Lazily: `import tunekit` stays free of torch (the CLI's fast paths rely on it).
    if name in ("Workload", "load_workload"):
        from tunekit import workload

        return getattr(workload, name)
    if name == "prepare":
        from tunekit.prepared import prepare

        return prepare
    raise AttributeError(f"module 'tunekit' has no attribute {name!r}")
