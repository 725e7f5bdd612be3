"""A GPU profile made by hand: the example the profile's reader and the GPU path's
CPU checks start from (data/profiles/README.md defines the format)."""

EXAMPLE = {
    "schema": "ficco-gpu-profile",
    "schema_version": 1,
    "created_utc": "2026-01-01T00:00:00+00:00",
    "complete": True,
    "device": {"name": "NVIDIA H200", "compute_capability": "9.0", "multiprocessor_count": 132,
               "total_memory_gib": 139.8, "count_visible": 1},
    "software": {"torch": "2.13.0+cu128", "cuda": "12.8", "float32_matmul_precision": "highest",
                 "python": "3.11.7"},
    "preset": "h200-nvswitch",
    "budget_s": 390,
    "elapsed_s": 301.5,
    "fitted": {
        "gemm_tflops": {"bfloat16": 702.5, "float16": 698.0, "float32": 51.2},
        "gemm_efficiency": {"bfloat16": 0.71, "float16": 0.7055, "float32": 0.1035},
        "gemm_shape": {"bfloat16": [16384, 8192, 8192], "float16": [16384, 8192, 8192],
                       "float32": [8192, 8192, 8192]},
        "gemm_call_us": 7.9,
        "dma_latency_us": 9.5, "dma_bw_gbps": 1480.0,
        "sm_copy_latency_us": 3.1, "sm_copy_bw_gbps": 1850.0,
        "h2d_latency_us": 11.0, "h2d_bw_gbps": 52.0,
        "cil_gemm_dma": 0.08, "cil_gemm_sm": 0.35, "cil_copy_dma": 0.2, "cil_copy_sm": 0.6,
    },
    "measurements": {
        "dil": [
            {"dtype": "bfloat16", "m": 1024, "n": 1024, "k": 1024, "split": "m", "d": 8,
             "t_whole_us": 12.0, "t_pieces_us": 60.0, "dil": 4.0},
            {"dtype": "bfloat16", "m": 8192, "n": 8192, "k": 8192, "split": "n", "d": 2,
             "t_whole_us": 1600.0, "t_pieces_us": 1650.0, "dil": 0.0312},
        ],
    },
    "sections": {"gemm_peak": {"status": "ok", "message": "", "elapsed_s": 12.1}},
}
