"""The printed table of a context-parallel benchmark result (benchmarks/context_parallel.py's
rows and overlap entries), shared by the benchmark and scripts/multi_gpu_summary.py; no jax."""

from __future__ import annotations


def _number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_lines(rows: list[dict], overlaps: list[dict]) -> list[str]:
    """One line per row (ms, TF/s per device, scaling efficiency, first call's seconds), the
    flash kernels the rows used, then each overlap entry with its per-GPU split."""
    lines = [f"{'s':>7} {'impl':<10} {'lb':<4} {'pass':<8} {'ms':>9} {'TF/s/dev':>9} {'eff':>6} "
             f"{'1st s':>6}"]
    for row in rows:
        lines.append(f"{row['seqlen']:>7} {row['impl']:<10} {str(row.get('load_balance') or '-'):<4} "
                     f"{row['pass']:<8} {row['median_ms']:>9.2f} {row['tflops_per_device']:>9.1f} "
                     f"{_number(row.get('scaling_efficiency'), '.3f'):>6} "
                     f"{_number(row.get('first_call_s'), '.1f'):>6}")
    kernels = {row["kernels"] for row in rows if "kernels" in row}
    if kernels:
        lines.append(f"flash kernels: {', '.join(sorted(kernels))}")
    for entry in overlaps:
        where = f"overlap {entry['impl']} lb={entry.get('load_balance')} s={entry['seqlen']}"
        if "error" in entry:
            lines.append(f"{where}: {entry['error'][:200]}")
            continue
        lines.append(f"{where}: fraction {entry['overlap_fraction']}, exposed "
                     f"{entry['exposed_ms_per_call']} ms per call per GPU (trace "
                     f"{entry.get('trace_s', '?')} s)")
        for gpu in entry.get("gpus", []):
            lines.append(f"    {gpu['gpu']}: communication {gpu['communication_ms_per_call']} ms, "
                         f"overlapped {gpu['overlapped_ms_per_call']} ms, compute "
                         f"{gpu['compute_ms_per_call']} ms per call")
    return lines
