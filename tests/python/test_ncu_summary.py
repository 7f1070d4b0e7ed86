"""CPU test of bench/reports/ncu_summary.py on a synthetic Nsight Compute raw page (header, unit row, a row per
kernel, as `ncu --import R --csv --page raw` writes it).
    python3 -m pytest -q tests/python/test_ncu_summary.py
"""
import csv
import importlib.util
import os

import pytest

_spec = importlib.util.spec_from_file_location(
    "ncu_summary", os.path.join(os.path.dirname(__file__), "..", "..", "bench", "reports", "ncu_summary.py"))
ns = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ns)

HEADER = ["ID", "Process ID", "Kernel Name", "gpu__time_duration.sum",
          "sm__throughput.avg.pct_of_peak_sustained_elapsed",
          "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
          "lts__throughput.avg.pct_of_peak_sustained_elapsed",
          "dram__throughput.avg.pct_of_peak_sustained_elapsed",
          "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"]


def write(tmp_path, units, rows):
    p = tmp_path / "r.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        f.write("==PROF== Connected to process 1\n")   # ncu's own lines are skipped
        w.writerow(HEADER)
        if units is not None:
            w.writerow(units)
        for r in rows:
            w.writerow(r)
    return str(p)


UNITS = ["", "", "", "usecond", "%", "%", "%", "%", "", "", "", ""]
ROWS = [
    ["0", "1", "void smoe::engine::engine_kernel<smoe::engine::VarlenKKernel<Cfg<256>, EpiStoreT>>(T)",
     "1,234.5", "41.0", "80.5", "79.0", "30.0", "0.5", "7.25", "2.0", "1.0"],
    ["1", "1", "route_kernel", "12.0", "5.0", "60.0", "20.0", "55.0", "9.0", "0", "0", "0.5"],
]


def test_one_line_per_kernel_with_throughputs_and_top_stalls(tmp_path):
    out = ns.summarize(write(tmp_path, UNITS, ROWS)).splitlines()
    assert len(out) == 2 + len(ROWS)
    first = out[2]
    assert "VarlenKKernel" in first and "smoe::engine::" not in first
    assert "| 1234.5 | 41.0 | 80.5 | 79.0 | 30.0 | - |" in first      # us (usecond unit), SM, mem, L2, DRAM, occ
    assert first.rstrip(" |").endswith("barrier 7.2, math_pipe_throttle 2.0, wait 1.0")  # top 3, largest first
    assert "long_scoreboard 9.0, wait 0.5 |" in out[3]                  # zero stalls left out


def test_nanosecond_durations_are_scaled_to_microseconds(tmp_path):
    units = list(UNITS)
    units[3] = "nsecond"
    out = ns.summarize(write(tmp_path, units, ROWS)).splitlines()
    assert "| 1.2 | 41.0 |" in out[2]


def test_a_page_without_kernels_is_an_error(tmp_path):
    with pytest.raises(SystemExit):
        ns.summarize(write(tmp_path, UNITS, []))


def test_dram_bytes_columns_where_the_report_has_them(tmp_path):
    header = HEADER + ["dram__bytes_read.sum", "dram__bytes_write.sum"]
    units = UNITS + ["Gbyte", "Mbyte"]
    rows = [r + v for r, v in zip(ROWS, [["7.508016", "1,614.9"], ["0.5", "12.0"]])]
    p = tmp_path / "r.csv"
    with open(p, "w", newline="") as f:
        w = csv.writer(f)
        w.writerows([header, units] + rows)
    out = ns.summarize(str(p)).splitlines()
    assert "| DRAM rd GB | DRAM wr GB |" in out[0]
    assert "| 30.0 | - | 7.51 | 1.61 |" in out[2]     # Gbyte as is, Mbyte / 1000
    assert "| 0.50 | 0.01 |" in out[3]
    # Without the metrics the table is as before.
    assert "DRAM rd GB" not in ns.summarize(write(tmp_path, UNITS, ROWS))


def test_long_names_keep_their_epilogue():
    name = ("void smoe::engine::engine_kernel<smoe::engine::VarlenMKernel<smoe::engine::TileConfig<(int)128, (int)6, "
            "(cute::SM90::GMMA::Major)0, (cute::SM90::GMMA::Major)1, (bool)1, (int)1, (int)128>, "
            "(smoe::engine::ALoad)1, smoe::engine::EpiDSwiGLUT<(bool)0>>>(T1::Params)")
    s = ns.short_name(name)
    assert len(s) <= 70 and s.endswith("... EpiDSwiGLUT") and s.startswith("void engine_kernel<VarlenMKernel<")
    assert ns.short_name("route_kernel") == "route_kernel"
