"""Characterize one CUDA GPU for the simulator: GEMM, copy and contention microbenchmarks.

    python -m ficco_select.data.gpu_profile.run --out DIR [--budget-s N] [--preset NAME] [--sections a,b]

(``scripts/gpu_check.sh`` runs it with a hard time limit.) Sections run in order, each
against its own share of the time budget and guarded (``runner``): a section that fails
records its error and the next one runs. Everything goes into ``DIR/profile.json`` (the
format of ``ficco_select.data.gpu_profile.read``, every field documented in ``data/profiles/README.md``),
rewritten atomically after every section and every few seconds during one, so a run killed
by a timeout still leaves what it had measured.

Sections (times are GPU time between CUDA events unless said otherwise; each module's
docstring says what it measures):

1. ``gemm_peak``, 2. ``dil``: ``gemm`` (GEMM throughput, one tiny call, decomposition loss);
3. ``copy_dma``, 4. ``copy_sm``, 5. ``copy_h2d``, 6. ``cil``: ``copies`` (latency and
   bandwidth per copy engine, contention with a GEMM);
7. ``loopback_correctness``, 8. ``loopback_realized``: ``realized`` (every legal schedule
   verified, then timed: realized fraction of the ideal overlap speedup).

Importing this module needs torch but no GPU; ``main`` exits with a message without CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ficco_select.data.gpu_profile.copies import section_cil, section_copy_dma, section_copy_h2d, section_copy_sm
from ficco_select.data.gpu_profile.gemm import section_dil, section_gemm_peak
from ficco_select.data.gpu_profile.read import SCHEMA, SCHEMA_VERSION
from ficco_select.data.gpu_profile.realized import section_loopback_correctness, section_loopback_realized
from ficco_select.data.gpu_profile.runner import Run, Section, run_sections, write_on_term
from ficco_select.hardware import preset_for_device

log = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 390.0
"""Seconds for all sections together (scripts/gpu_check.sh kills the process 30 s later)."""

SECTIONS = (
    Section("gemm_peak", 30, section_gemm_peak),
    Section("dil", 50, section_dil),
    Section("copy_dma", 25, section_copy_dma),
    Section("copy_sm", 20, section_copy_sm),
    Section("copy_h2d", 10, section_copy_h2d),
    Section("cil", 25, section_cil),
    Section("loopback_correctness", 90, section_loopback_correctness),
    Section("loopback_realized", None, section_loopback_realized),
)


def _environment(preset: str | None, device: str = "cuda") -> dict[str, Any]:
    from importlib import metadata

    try:
        version = metadata.version("ficco-select")
    except metadata.PackageNotFoundError:
        version = None
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "complete": False,
        "device": _device(device),
        "software": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "hip": getattr(torch.version, "hip", None),
                     "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                     "float32_matmul_precision": torch.get_float32_matmul_precision(),
                     "python": platform.python_version(), "ficco_select": version, "host": platform.node()},
        "preset": preset,
        "fitted": {},
        "measurements": {},
        "sections": {s.name: {"status": "pending", "message": ""} for s in SECTIONS},
    }


def _device(device: str) -> dict[str, Any]:
    """What the profile ran on: the GPU's properties, or the CPU of a rehearsal."""
    if device == "cpu":
        return {"name": f"cpu ({platform.processor() or platform.machine()}, rehearsal)", "compute_capability": "none",
                "multiprocessor_count": os.cpu_count() or 1, "total_memory_gib": 0.0, "count_visible": 0}
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessor_count": int(props.multi_processor_count),
            "total_memory_gib": round(props.total_memory / 2 ** 30, 2), "count_visible": torch.cuda.device_count()}


def profile(out: Path, *, budget_s: float, preset: Any, preset_name: str | None, sections: Sequence[str] | None = None,
            device: str = "cuda", tiny: bool = False) -> tuple[Run, bool]:
    """The sections (all, or `sections`) into ``out/profile.json`` within `budget_s`: the
    run, and whether every section returned (False: one hung and was abandoned). `device`
    ``cpu`` with `tiny`: a rehearsal of the logic on the CPU (``Run.tiny``), no measurement."""
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out=out, deadline=time.monotonic() + budget_s, state=_environment(preset_name, device), preset=preset,
              device=device, tiny=tiny)
    run.state["budget_s"] = budget_s
    wanted = set(sections or [s.name for s in SECTIONS])
    for s in SECTIONS:
        if s.name not in wanted:
            run.state["sections"][s.name] = {"status": "skipped", "message": "skipped: not in --sections"}
    previous = write_on_term(run)
    try:
        returned = run_sections(run, [s for s in SECTIONS if s.name in wanted])
        run.state["complete"] = all(run.state["sections"][s]["status"] == "ok" for s in wanted)
        run.write()
    finally:  # a caller that goes on after the profile (ficco bring-up) keeps its own handler
        signal.signal(signal.SIGTERM, previous)
    return run, returned


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ficco_select.data.gpu_profile.run",
        description="Characterize one CUDA GPU for ficco-select: GEMM throughput and DIL, copy-engine "
                    "and SM copy latency/bandwidth, contention (CIL), loopback correctness and realized "
                    "overlap. Writes OUT/profile.json as it goes (see data/profiles/README.md).")
    p.add_argument("--out", required=True, type=Path, help="Folder for profile.json (created).")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"Seconds for all sections together (default {DEFAULT_BUDGET_S:.0f}).")
    p.add_argument("--preset", default="auto",
                   help="Preset whose peak TFLOP/s gemm_efficiency is relative to; 'auto': by device name.")
    p.add_argument("--sections", default=",".join(s.name for s in SECTIONS),
                   help="Comma-separated subset of sections, in the default order.")
    args = p.parse_args(argv)
    if args.budget_s <= 0:
        p.error("--budget-s must be positive")
    unknown = set(args.sections.split(",")) - {s.name for s in SECTIONS}
    if unknown:
        p.error(f"--sections: unknown {', '.join(sorted(unknown))}; known: {', '.join(s.name for s in SECTIONS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    if not torch.cuda.is_available():
        print(f"gpu_profile: no CUDA device visible to torch {torch.__version__} "
              f"(torch.version.cuda={torch.version.cuda}); this profiler needs a GPU and a CUDA build of torch. "
              "Nothing was measured.", file=sys.stderr)
        return 2
    from ficco_select.hardware import HardwareError, load_hardware

    name = torch.cuda.get_device_name(0)
    preset_name = preset_for_device(name) if args.preset == "auto" else args.preset
    preset = None
    if preset_name:
        try:
            preset = load_hardware(preset_name)
        except HardwareError as e:
            print(f"gpu_profile: --preset: {e}", file=sys.stderr)
            return 2
    else:
        log.warning("no preset matches %r: gemm_efficiency is not computed (pass --preset)", name)
    log.info("profiling %s (preset %s), budget %.0f s -> %s", name, preset_name, args.budget_s,
             args.out / "profile.json")
    run, returned = profile(args.out, budget_s=args.budget_s, preset=preset, preset_name=preset_name,
                            sections=args.sections.split(","))
    log.info("wrote %s (complete: %s)", run.path, run.state["complete"])
    if not returned:  # a section thread is still running: do not wait for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
