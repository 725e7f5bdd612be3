"""Published-measurement tables made for a test: rows under the committed validation table's
header (``write_table``)."""

import csv
from pathlib import Path

VALIDATION = Path(__file__).parents[2] / "data" / "published" / "validation.csv"
"""The committed validation table, whose header every table made here takes."""


def write_table(path: Path, rows: list[dict]) -> Path:
    """`rows` under the committed validation table's header, written to `path`."""
    with VALIDATION.open(encoding="utf-8") as f:
        header = next(csv.reader(f))
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    return path
