"""bench/reports/sonic_profile_report.py: kernel names to roles, per-role sums and the sonic / ours ratio,
unknown names kept visible under "other"."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "reports" / "sonic_profile_report.py"
spec = importlib.util.spec_from_file_location("sonic_profile_report", SCRIPT)
spr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(spr)


def test_roles():
    assert spr.role_of("void smoe::engine::engine_kernel<Traits<Cfg, EpiDSwiGLUT<false>>>") == "dA' (dSwiGLU + dS)"
    assert spr.role_of("void smoe::engine::engine_kernel<Traits<Cfg, EpiSwiGLUT<false>>>") == "up-proj (SwiGLU)"
    assert spr.role_of("void smoe::engine::engine_kernel<Traits<Cfg, EpiStore>>").startswith("store GEMMs")
    assert spr.role_of("kernel_cutlass_GemmDActSm90_object") == "dA' (dSwiGLU + dS)"
    assert spr.role_of("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNT") == "router GEMM"
    assert spr.role_of("token_gather_sum_kernel") == "sums (aggregate, dX~ sum, dS)"
    assert spr.role_of("_topk_over_softmax_bwd_kernel") == "routing (top-K, counts, order)"
    assert spr.role_of("void at::native::vectorized_elementwise_kernel<4, FillFunctor>") == "other"


def test_report_sums_and_ratio():
    doc = {"commit": "c", "gpu": "g", "iters": 5, "configs": {"cfg A": {
        "ours": {"sum_ms": 3.0, "kernels": [
            {"name": "engine_kernel<EpiDSwiGLU>", "ms": 2.0}, {"name": "fill_kernel_x", "ms": 1.0}]},
        "sonicmoe": {"sum_ms": 6.0, "kernels": [
            {"name": "GemmDActSm90", "ms": 1.0}, {"name": "GemmDActSm90 other tile", "ms": 4.0},
            {"name": "elementwise", "ms": 1.0}]}}, "cfg B": {"ours": {"sum_ms": 1.0, "kernels": []}}}}
    by, other = spr.by_role(doc["configs"]["cfg A"]["sonicmoe"]["kernels"])
    assert by["dA' (dSwiGLU + dS)"] == 5.0 and other == [("elementwise", 1.0)]
    text = spr.report(doc)
    assert "| dA' (dSwiGLU + dS) | 2.000 | 5.000 | 2.50 |" in text
    assert "| **all kernels** | **3.000** | **6.000** | **2.00** |" in text
    assert "`fill_kernel_x` 1.000" in text and "only ours profiled" in text
