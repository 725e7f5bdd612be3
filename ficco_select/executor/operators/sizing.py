"""What one rank of a measurement allocates, checked before any rank starts."""

from __future__ import annotations

from ficco_select.scenario import Scenario
from ficco_select.schedule import degrees


def rank_buffer_bytes(scenario: Scenario) -> int:
    """An upper bound on what one rank of a measurement allocates for `scenario`: the
    operator's buffers (every schedule's, as measurement builds them eagerly), its float32
    reference and the float32 copies verification makes. For the busiest rank (the hot
    expert's, for a2a_gemm), so P times this bounds a node's P ranks. Checked before any
    rank starts (``ficco_select.data.measure.sweep``): a shape that cannot fit is refused, not allocated.
    """
    s, P, b = scenario, scenario.world_size, scenario.dtype_bytes
    f32 = 4
    if s.op == "ag_gemm":
        # A_full (m, k), W_r (k, n/P), out (m, n/P); reference: the same in float32 + out copy.
        elems = s.m * s.k + s.k * (s.n // P) + s.m * (s.n // P)
        return elems * b + (elems + s.m * (s.n // P)) * f32
    if s.op in ("gemm_rs", "gemm_ar"):
        # gemm_ar: gemm_rs's buffers (its output is C, whole) and a float32 (m, n) reference.
        # A (m, k/P), W (k/P, n); C, recv_peers: (m, n) each; recv (2, m/P, n), out_n (m/P, n);
        # column pieces: partials (m, n) + receive slots (m, n) per degree. Reference: the
        # float32 partial (m, n), inputs, output block.
        inputs = s.m * (s.k // P) + (s.k // P) * s.n
        work = (2 + 2 * len(degrees(P))) * s.m * s.n + 3 * (s.m // P) * s.n
        return (inputs + work) * b + (inputs + s.m * s.n + 2 * (s.m // P) * s.n) * f32
    # a2a_gemm: X (tokens sent, k), W (k, n), X_recv (tokens received, k), out (received, n).
    # gemm_a2a: X_recv (received, k), W (k, n), Y and the contention probe's slots (received,
    # n), out (sent, n): within the same bound with sent and received at their largest.
    counts = s.token_counts()
    sent = max(sum(row) for row in counts)
    received = max(sum(counts[q][r] for q in range(P)) for r in range(P))
    if s.op == "gemm_a2a":
        sent = received = max(sent, received)
        elems = received * s.k + s.k * s.n + 3 * received * s.n
        return elems * b + (elems + received * s.n) * f32
    elems = sent * s.k + s.k * s.n + received * (s.k + s.n)
    return elems * b + (elems + received * s.n) * f32
