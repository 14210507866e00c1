"""Help: the keys, the workflow, and where each action lives."""

from __future__ import annotations

from rich.markdown import Markdown
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from tunekit.tui.screens.base import TunekitScreen

HELP = """\
# tunekit

Watch the job, see what each tuner thinks of it, verify candidates with short
real trials, and apply the winner to the job that is running now.

| key | where | what |
|---|---|---|
| `1` … `5`, `?` | everywhere | live · profile · tuners · trials · apply · this help |
| `ctrl+p` | everywhere | command palette: every action below by name |
| `t` | everywhere | start a tuning with the enabled tuners (trials run as separate processes; the UI never waits) |
| `x` | tuners, trials | cancel the tuning (the study stays resumable) |
| `p` | profile | profiled run: step breakdown, per-layer times, py-spy hot spots |
| `s` / click a header | profile | sort the layer table by the column under the cursor (`←` `→` move it); again: reverse |
| `space` | tuners | enable or disable the highlighted tuner |
| `d` | tuners | diagnose and plan with the enabled tuners now, without trials (the tuners screen says which tuner runs and what it measures) |
| `a` | trials | apply the highlighted trial's config (asks first) |
| `enter` | trials | make the highlighted trial's config the one to apply |
| `a` | apply | apply the config on the right to the live job (asks first) |
| `r` | apply | roll back to the config before the last apply (asks first) |
| `b` | apply | take the best config of the tuning again |
| `q` | everywhere | quit: a job this app started is checkpointed and stopped; an attached one keeps running |

**Applying.** The job switches at its next step boundary; model and optimizer
state carry over. It is then watched for a window of steps: slower beyond
noise, and it rolls back by itself. When the tuning's decision kept the
baseline, the best *measured* candidate is offered instead, marked in yellow.

**Charts** are drawn on their quantity's own scale where it has one (CPU and GPU
utilisation 0–100%, memory up to the device's), else between the minimum and the
maximum written beside them. ▲ marks an apply, ↺ a rollback; each config the job
ran has its own colour (a step at batch 64 is not a step at batch 32).

**Without a GPU** the live screen shows host metrics only (CPU and memory per
rank) and says so once.

**Failures** (a plugin that does not load or whose diagnosis raises, a trial
that crashes, hangs or runs out of memory) are notifications; the app and the
job keep going.
"""


class HelpScreen(TunekitScreen):
    """See the module docstring. The text is one Rich renderable, not Textual's Markdown
    widget (a widget per table cell: its first visit took seconds on a busy machine)."""

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="help-body"):
            yield Static(Markdown(HELP), id="help-text")
