"""The ``stepmill`` command. Each command parses its options, calls the room that does the work and
prints the result; the commands live by what they are about (capture, data, curate, runs, fleet) and all
stand at the top level (``stepmill export``)."""

from __future__ import annotations

import sys

import click

from stepmill import __version__
from stepmill.cli import capture, curate, data, fleet, runs, train
from stepmill.errors import StepmillError
from stepmill.experiment.command import experiment

__all__ = ["main"]


class StepmillGroup(click.Group):
    """The one place a stepmill error becomes ``Error: <message>`` and exit status 1, and Ctrl-C exit
    status 130 with the command's word on it (``options.on_interrupt``)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except StepmillError as exc:
            raise click.ClickException(str(exc)) from None
        except KeyboardInterrupt:
            # The command's own clean-up (its finally blocks: children stopped) ran on the way here.
            command = self.commands.get(ctx.invoked_subcommand or "")
            click.echo(getattr(command, "interrupted", "interrupted"), err=True)
            sys.exit(130)


@click.group(cls=StepmillGroup)
@click.version_option(__version__)
def main():
    """stepmill: agents' LLM traffic in, training-ready RL step records out."""


for _command in (*capture.COMMANDS, *data.COMMANDS, *curate.COMMANDS, *runs.COMMANDS, *fleet.COMMANDS, *train.COMMANDS):
    main.add_command(_command)
del _command
main.add_command(experiment)  # its code lives in stepmill/experiment
