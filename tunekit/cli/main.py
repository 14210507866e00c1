"""``tunekit``: one command with subcommands.

Bad input raises a :class:`tunekit.errors.TunekitError`; :func:`main` prints it
as one line and exits with its code (2). Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

import click

from tunekit import __version__
from tunekit.cli.auto import auto_cmd
from tunekit.cli.common import err_console
from tunekit.cli.hardware import hardware_group
from tunekit.cli.new_plugin import new_plugin_cmd
from tunekit.cli.plan import plan_cmd
from tunekit.cli.plugins import plugins_cmd
from tunekit.cli.profile import profile_cmd
from tunekit.cli.report import report_cmd
from tunekit.cli.run import COMMANDS as RUN_COMMANDS
from tunekit.errors import TunekitError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="tunekit")
def cli() -> None:
    """Profiler-driven auto-tuner for distributed PyTorch training."""


for command in (auto_cmd, plan_cmd, plugins_cmd, report_cmd, profile_cmd, hardware_group, new_plugin_cmd,
                *RUN_COMMANDS):
    cli.add_command(command)

# Commands outside the core (the TUI) register under this entry-point group,
# as tuners do, so the core never imports them.
for _ep in sorted(entry_points(group="tunekit.commands"), key=lambda e: e.name):
    cli.add_command(_ep.load(), _ep.name)


def _init_profiler_here() -> None:
    """Start torch.profiler once in the main thread: kineto complains (on stderr)
    when its first use is in another thread, and tuners profile from worker threads."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]):
        pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("auto", "plan", "tui", "profile"):
        _init_profiler_here()
    try:
        cli.main(args=argv, prog_name="tunekit", standalone_mode=False)
    except click.exceptions.Abort:
        err_console.print("aborted")
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except TunekitError as exc:
        err_console.print(f"[bold red]error:[/] {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
