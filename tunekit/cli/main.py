"""``tunekit``: one command with subcommands.

Bad input raises a :class:`tunekit.errors.TunekitError`; :func:`main` prints it
as one line and exits with its code (2). Anything else is a bug and keeps its
traceback.

Subcommands are imported when they run, so that the ones that only talk to a
live job (``status``, ``apply``, ``stop`` ...) start in a fraction of a second
instead of paying for torch.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
from importlib.metadata import EntryPoint, entry_points

import click

from tunekit import __version__
from tunekit.cli.common import err_console, interruption, styled
from tunekit.effort import measure_effort
from tunekit.errors import TunekitError
from tunekit.trials.warm_start import CPP_LOG_LEVEL

COMMANDS = {
    "apply": "tunekit.cli.run:apply_cmd",
    "auto": "tunekit.cli.auto:auto_cmd",
    "follow": "tunekit.cli.follow:follow_cmd",
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

SUMMARIES = {
    "apply": "Apply CONFIG (PLUGIN.knob=value pairs, best_config.json or inline JSON) to the live RUN at its next step boundary.",
    "auto": "Tune WORKLOAD (path/file.py:fn, package.module:fn or example:NAME).",
    "follow": "Follow the coordinator at HOST:PORT: run this node's torchrun agent for every trial it announces.",
    "hardware": "Hardware models: measure this machine or validate and print a profile.",
    "new-plugin": "Create a tuner plugin package called NAME (a lower-case identifier, e.g. my_tuner).",
    "plan": "Print PLUGIN's diagnosis and ranked candidates for WORKLOAD with predicted step times.",
    "plugins": "List installed tuner plugins: name, aspect, title, package, status.",
    "profile": "Profile WORKLOAD on NPROC ranks and print where the step time goes.",
    "report": "Print STUDY (an id; default: the latest) from the study store.",
    "rollback": "Go back to the config RUN had before its last apply.",
    "run": "Train WORKLOAD under torchrun until done or stopped; control it with apply/trial/rollback/stop.",
    "status": "Print what the live RUN is doing (default: the latest run).",
    "stop": "Checkpoint RUN and stop it cleanly (resume later with tunekit run --resume RUN).",
    "trial": "Try CONFIG inside the live RUN (candidate and current in alternating windows); keep the faster.",
}
"""Each core command's first help line, so that ``tunekit --help`` imports none of them
(most import torch: 2 s). A test keeps these equal to the commands' own."""


_ENVIRONMENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}
"""Filesystem errors the machine causes (permissions, a read-only or full disk), not tunekit:
one line, like bad input, wherever they surface."""


def _extension_commands() -> dict[str, EntryPoint]:
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

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        width = formatter.width - 6 - max(len(n) for n in self.list_commands(ctx))
        rows = []
        for name in self.list_commands(ctx):
            if name in SUMMARIES and name not in self.commands:
                # click's own shortening of a help text, without importing the command
                rows.append(
                    (name, click.Command(name, help=SUMMARIES[name]).get_short_help_str(width))
                )
            elif (command := self.get_command(ctx, name)) is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(width)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, prog_name="tunekit")
def cli() -> None:
    """Profiler-driven auto-tuner for distributed PyTorch training."""
    measure_effort()  # a bad $TUNEKIT_MEASURE_EFFORT is one line before any work


SHARED_OUTPUT = {"new-plugin"}
"""Commands whose files are for others: a plugin scaffold is source code to share. Every other
command creates what it writes private (see :func:`main`)."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # Studies, trial folders, followers' node files, reports and logs hold configs, results and
    # the workload's output: nobody else's business. Umask 077 makes every file and folder this
    # process and the ones it starts (torchrun, ranks, the workload's child) create private
    # (0600/0700), whoever created the folder above them.
    user_umask = os.umask(0o077) if not args or args[0] not in SHARED_OUTPUT else None
    # Before torch loads (it reads this once): torch's C++ log from errors up, as in every
    # process tunekit starts, so that the one that forks them can be a fork of this one.
    os.environ.setdefault(CPP_LOG_LEVEL, "ERROR")
    try:
        return _main(argv)
    finally:
        if user_umask is not None:
            os.umask(user_umask)


def _main(argv: list[str] | None) -> int:
    # Commands that profile start torch.profiler themselves, once their input is known to be good.
    try:
        cli.main(args=argv, prog_name="tunekit", standalone_mode=False)
    except click.exceptions.Abort:
        err_console.print("aborted")
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except TunekitError as exc:
        # literal: a message naming an extra (pip install 'tunekit[hf]') is not rich markup
        err_console.print(
            str(exc) if exc.exit_code in (130, 143) else styled("[bold red]error:[/] {}", exc)
        )
        return exc.exit_code
    except KeyboardInterrupt:
        said, code = interruption()
        err_console.print(said)
        return code
    except OSError as exc:
        if exc.errno not in _ENVIRONMENT_ERRNOS:
            raise  # anything else is a bug in tunekit: keep its traceback
        where = f": {exc.filename}" if exc.filename else ""
        err_console.print(styled("[bold red]error:[/] {}{}", exc.strerror or exc, where))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
