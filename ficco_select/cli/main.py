"""The `ficco` command line: one subcommand per stage, each a thin wrapper.

Each subcommand parses its options, builds a config, calls one function of its stage and
prints the result (a table, or JSON with --json) through `ficco_select.cli.output`. This module
holds the group, sets up logging once, and registers the commands of:

- `ficco_select.cli.data_cmds`: measure, catalog, simulate, dataset (validate, info, compare)
- `ficco_select.cli.hardware_cmds`: hardware (list, show, from-profile), sim (validate, calibrate)
- `ficco_select.cli.train_cmds`: evaluate, train, pipeline, export, report
- `ficco_select.cli.select_cmds`: select
- `ficco_select.cli.advise_cmds`: advise
"""

from __future__ import annotations

import logging
import os
import sys

import click

from ficco_select.cli import advise_cmds, data_cmds, hardware_cmds, select_cmds, train_cmds


class _OneLineErrors(click.Group):
    """What the commands do not catch themselves but a user causes (a read-only or full
    output, a file-size limit, an MLflow store that is not one) ends in one line naming the
    file or the store, never a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            raise click.ClickException(f"{where}{e.strerror or e}") from None
        except Exception as e:
            if type(e).__module__.split(".")[0] not in ("mlflow", "sqlalchemy", "alembic"):
                raise
            store = os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db (the default)")
            first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
            raise click.ClickException(f"MLflow tracking store {store}: {first}") from None


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log lines on stderr (-v: info, -vv: debug).")
def main(verbose: int) -> None:
    """ficco-select: measure, learn and select compute-communication overlap schedules."""
    # The one place logging is set up: every stage only logs to its module's logger.
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


for _module in (data_cmds, hardware_cmds, train_cmds, select_cmds, advise_cmds):
    for _command in _module.COMMANDS:
        main.add_command(_command)


if __name__ == "__main__":
    main()
