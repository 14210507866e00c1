"""``tunekit``: one command with subcommands.

Bad input raises a :class:`tunekit.errors.TunekitError`; :func:`main` prints it
as one line and exits with its code (2). Anything else is a bug and keeps its
traceback.

Subcommands are imported when they run, so that the ones that only talk to a
live job (``status``, ``apply``, ``stop`` ...) start in a fraction of a second
instead of paying for torch.
"""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import entry_points

import click

from tunekit import __version__
from tunekit.cli.common import err_console
from tunekit.errors import TunekitError

COMMANDS = {
    "apply": "tunekit.cli.run:apply_cmd",
    "auto": "tunekit.cli.auto:auto_cmd",
    "hardware": "tunekit.cli.hardware:hardware_group",
    "new-plugin": "tunekit.cli.new_plugin:new_plugin_cmd",
    "plan": "tunekit.cli.plan:plan_cmd",
    "plugins": "tunekit.cli.plugins:plugins_cmd",
    "profile": "tunekit.cli.profile:profile_cmd",
    "report": "tunekit.cli.report:report_cmd",
    "rollback": "tunekit.cli.run:rollback_cmd",
    "run": "tunekit.cli.run:run_cmd",
    "status": "tunekit.cli.run:status_cmd",
    "stop": "tunekit.cli.run:stop_cmd",
    "trial": "tunekit.cli.run:trial_cmd",
}
"""The core's commands: name -> ``module:attribute``."""


def _extension_commands() -> dict[str, object]:
    """Commands outside the core (the TUI) register under this entry-point group, as
    tuners do, so the core never imports them."""
    return {ep.name: ep for ep in entry_points(group="tunekit.commands")}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMANDS, *_extension_commands()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands:
            return self.commands[name]
        if name in COMMANDS:
            module, attr = COMMANDS[name].split(":")
            command = getattr(importlib.import_module(module), attr)
        elif (ep := _extension_commands().get(name)) is not None:
            command = ep.load()
        else:
            return None
        self.add_command(command, name)
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="tunekit")
def cli() -> None:
    """Profiler-driven auto-tuner for distributed PyTorch training."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("plan", "tui", "profile"):
        from tunekit.observe.kineto import start_profiler_in_main_thread

        start_profiler_in_main_thread()  # `auto` does it once its workload has loaded
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
