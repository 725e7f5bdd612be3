#!/usr/bin/env bash
# The measured fabric sweeps: data/scenarios/catalog_fabric.csv on three shaped fabrics, then
# an independent second sweep of each (another --out, measured after all the first ones).
# Resumable: rerun it after a kill and every finished scenario is kept.
#   scripts/fabric_sweeps.sh [RATE ...]     (default: 2gbit 1gbit 500mbit)
set -euo pipefail
cd "$(dirname "$0")/.."
FICCO=${FICCO:-.venv/bin/ficco}
RATES=("${@:-2gbit 1gbit 500mbit}")
read -r -a RATES <<< "${RATES[*]}"
for sweep in "" _repeat; do
  for rate in "${RATES[@]}"; do
    "$FICCO" measure --scenarios data/scenarios/catalog_fabric.csv --fabric "$rate" --reps 5 \
      --out "data/measured/fabric_${rate}${sweep}.parquet" --no-progress --json > /dev/null
    echo "fabric ${rate}${sweep}: done"
  done
done
