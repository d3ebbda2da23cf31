"""bench_step.py's summary of a profiled step: the GPU's busy time per phase and the host's CUDA calls."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_step  # noqa: E402


def test_a_trace_summary_counts_each_phase_kernels_by_their_launch_and_the_hosts_calls():
    def launch(ts, correlation, name="cudaLaunchKernel", dur=5.0):
        return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}

    def kernel(ts, dur, correlation, name="gemm"):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}

    events = [
        {"cat": "user_annotation", "name": "phase:forward", "ts": 0.0, "dur": 100.0},
        {"cat": "user_annotation", "name": "phase:backward", "ts": 100.0, "dur": 100.0},
        launch(10, 1), launch(20, 2), launch(30, 3, name="cudaStreamSynchronize", dur=40.0), launch(110, 4),
        kernel(50, 30, 1), kernel(60, 40, 2, name="swap"),  # launched in forward; overlapping: busy 50 µs over [50, 100]
        kernel(130, 500, 4),  # launched in backward, running past the phase's end
    ]  # fmt: skip
    summary = bench_step.summarize_trace(events, steps=1)
    forward, backward = summary["phases"]["forward"], summary["phases"]["backward"]
    assert (forward["gpu_busy_ms"], forward["gpu_span_ms"], forward["kernels"], forward["host_ms"]) == (0.05, 0.05, 2, 0.1)
    assert forward["host_cuda_calls"]["cudaStreamSynchronize"] == [1, 0.04, 40.0]
    assert forward["host_cuda_calls"]["cudaLaunchKernel"] == [2, 0.01, 5.0]
    assert (backward["gpu_busy_ms"], backward["kernels"]) == (0.5, 1)
    assert summary["kernels"] == [["gemm", 2.0, 0.53], ["swap", 1.0, 0.04]]
    assert "optimizer" not in summary["phases"]
