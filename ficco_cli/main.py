"""The `ficco` command line: one subcommand per stage, each a thin wrapper.

Each subcommand parses its options, builds a config, calls one function of its stage and
prints the result (a table, or JSON with --json) through `ficco_cli.output`. This module
holds the group, sets up logging once, and registers the commands of:

- `ficco_cli.data_cmds`: measure, catalog, simulate, dataset (validate, info, compare)
- `ficco_cli.hardware_cmds`: hardware (list, show, from-profile), sim (validate, calibrate)
- `ficco_cli.train_cmds`: evaluate, train, pipeline, export, report
- `ficco_cli.select_cmds`: select
"""

from __future__ import annotations

import logging
import sys

import click

from ficco_cli import data_cmds, hardware_cmds, select_cmds, train_cmds


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log lines on stderr (-v: info, -vv: debug).")
def main(verbose: int) -> None:
    """ficco-select: measure, learn and select compute-communication overlap schedules."""
    # The one place logging is set up: every stage only logs to its module's logger.
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


for _module in (data_cmds, hardware_cmds, train_cmds, select_cmds):
    for _command in _module.COMMANDS:
        main.add_command(_command)


if __name__ == "__main__":
    main()
