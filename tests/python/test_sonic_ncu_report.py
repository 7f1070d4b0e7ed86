"""CPU test of bench/reports/sonic_ncu_report.py: two synthetic ncu raw pages (ours, SonicMoE) of one config, a
manifest, and the per-GEMM table named by launch order.
    python3 -m pytest -q tests/python/test_sonic_ncu_report.py
"""
import csv
import importlib.util
import os
import sys

import pytest

_dir = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "reports")
sys.path.insert(0, _dir)
_spec = importlib.util.spec_from_file_location("sonic_ncu_report", os.path.join(_dir, "sonic_ncu_report.py"))
rep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rep)

HEADER = ["ID", "Kernel Name", "gpu__time_duration.sum", "launch__grid_size", "launch__block_size",
          "launch__cluster_dim_x", "launch__registers_per_thread", "launch__shared_mem_per_block_dynamic",
          "sm__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes_read.sum"]
UNITS = ["", "", "usecond", "", "", "", "register/thread", "Kbyte/block", "%", "Gbyte"]

OURS = [  # launch order of src/moe: router GEMM, routing, up, down, aggregate; dA', dW2, dW1 (two), dX~
    ("nvjet_sm90_tst_128x256_router", 50), ("topk_softmax_kernel", 20),
    ("engine_kernel<VarlenMKernel<TileConfig<256>, ALoad1, EpiSwiGLUT<false>>>", 3000),
    ("engine_kernel<VarlenMKernel<TileConfig<192>, ALoad0, EpiStoreStagedT<2>>>", 2000),
    ("gather_sum_kernel<0,1,4,1>", 800),
    ("engine_kernel<VarlenMKernel<TileConfig<256>, ALoad1, EpiDSwiGLUT<false>>>", 2100),
    ("engine_kernel<VarlenKKernel<TileConfig<256>, EpiStoreTma<false>>>", 1800),
    ("engine_kernel<VarlenKKernel<TileConfig<256>, EpiStoreTma<true>>>", 1700),
    ("engine_kernel<VarlenKKernel<TileConfig<256>, EpiStoreTma<true>>>", 1700),
    ("engine_kernel<VarlenMKernel<TileConfig<192>, ALoad0, EpiStoreStagedT<1>>>", 3500),
]
SONIC = [  # SonicMoE: up, down; dA', dW2, dX~, dW1
    ("kernel_cutlass_kernel_quackgemm_actGemmGatedSm90_x", 3200),
    ("kernel_cutlass_kernel_quackgemm_default_epiGemmDefaultSm90_a", 1900),
    ("token_gather_sum_kernel", 780),
    ("kernel_cutlass_kernel_quackgemm_dactGemmDGatedSm90_x", 2300),
    ("kernel_cutlass_kernel_quackgemm_default_epiGemmDefaultSm90_a", 1800),
    ("kernel_cutlass_kernel_quackgemm_default_epiGemmDefaultSm90_b", 2900),
    ("kernel_cutlass_kernel_quackgemm_default_epiGemmDefaultSm90_a", 3300),
]


def write(path, kernels, cluster):
    with open(path, "w", newline="") as f:
        f.write("==PROF== Disconnected from process 1\n")
        w = csv.writer(f)
        w.writerow(HEADER)
        w.writerow(UNITS)
        for i, (name, us) in enumerate(kernels):
            w.writerow([str(i), name, f"{us:,}", "132", "384", str(cluster), "168", "227.33", "71.5", "1.25"])


def make(tmp_path, ours=OURS, sonic=SONIC):
    write(tmp_path / "c.ours.csv", ours, 1)
    write(tmp_path / "c.sonicmoe.csv", sonic, 2)
    (tmp_path / "manifest.tsv").write_text("30B n256 E256 K16\tours\tc.ours.csv\n"
                                           "30B n256 E256 K16\tsonicmoe\tc.sonicmoe.csv\n")
    return rep.report(*rep.read_manifest(str(tmp_path)))


def row(text, role, system):
    return next(l for l in text.splitlines() if l.startswith(f"| {role} | {system} |"))


def test_each_gemm_is_named_by_launch_order_with_its_launch_configuration(tmp_path):
    text = make(tmp_path)
    assert "## 30B n256 E256 K16" in text
    up = row(text, "up-proj", "ours").split(" | ")
    assert up[2:9] == ["3.000", "132", "1", "384", "168", "222", "71.5"]     # ms, grid, cluster, block, regs, KB, SM%
    assert up[-3:-1] == ["1.25", "-"]                                         # DRAM read GB; write not collected
    assert row(text, "dX~", "SonicMoE").split(" | ")[2:4] == ["2.900", "132"]   # SonicMoE's 5th GEMM
    assert row(text, "dX~", "ours").split(" | ")[2] == "3.500"                # ours is the last
    dw1 = [l for l in text.splitlines() if l.startswith("| dW1 | ours |")]
    assert len(dw1) == 2                                                       # gate and up: both dW1
    assert row(text, "dW1", "sonic / ours").split(" | ")[2] == f"{3.3 / 3.4:.2f}"
    assert row(text, "dX~", "sonic / ours").split(" | ")[2] == f"{2.9 / 3.5:.2f}"
    assert "tensor%" in text and "| - |" in row(text, "up-proj", "ours")       # a metric not collected: "-"
    assert "All profiled kernels: ours 16.670 ms, SonicMoE 16.180 ms" in text


def test_launches_that_do_not_fit_the_order_are_listed_not_guessed(tmp_path):
    text = make(tmp_path, sonic=SONIC[:-1])
    assert "SonicMoE: its 5 GEMM launches do not fit the expected order" in text
    assert "SonicMoE, every kernel in launch order:" in text
    assert not any(l.startswith("| up-proj | SonicMoE |") for l in text.splitlines())
    assert row(text, "up-proj", "ours")


def test_a_run_that_cannot_be_read_is_named_and_the_others_still_report(tmp_path):
    write(tmp_path / "c.ours.csv", OURS, 1)
    (tmp_path / "c.sonicmoe.csv").write_text("==ERROR== the profiled process ran no kernel\n")
    (tmp_path / "manifest.tsv").write_text("cfg\tours\tc.ours.csv\ncfg\tsonicmoe\tc.sonicmoe.csv\n"
                                           "cfg2\tours\tmissing.csv\n")
    text = rep.report(*rep.read_manifest(str(tmp_path)))
    assert "Not read: cfg, sonicmoe: " in text and "Not read: cfg2, ours: " in text
    assert row(text, "up-proj", "ours") and "## cfg2" not in text
    assert any(l.startswith("| GEMM |") and "| DRAM wr GB |" in l for l in text.splitlines())


def test_a_bad_manifest_line_is_refused(tmp_path):
    write(tmp_path / "c.csv", OURS, 1)
    (tmp_path / "manifest.tsv").write_text("cfg\ttheirs\tc.csv\n")
    with pytest.raises(SystemExit, match="want 'config<TAB>ours|sonicmoe<TAB>csv'"):
        rep.read_manifest(str(tmp_path))
