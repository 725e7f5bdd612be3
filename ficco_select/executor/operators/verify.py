"""Verification of a schedule's output against the float32 reference."""

from __future__ import annotations

import torch

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}
"""Max |out - ref| / max(|ref|, 1) accepted per dtype (reference is float32)."""


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max(max |ref|, 1); inf for a wrong shape or a NaN (unwritten) output."""
    if out.shape != ref.shape:
        return float("inf")
    if ref.numel() == 0:
        return 0.0
    err = (out.float() - ref).abs().max().item()
    if err != err:  # NaN: a buffer was not written
        return float("inf")
    return err / max(ref.abs().max().item(), 1.0)
