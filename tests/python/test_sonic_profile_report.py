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


def test_launch_order_names_each_gemm():
    ours = [{"name": n, "ms": ms} for n, ms in (
        ("nvjet_router", 0.1), ("engine_kernel<VarlenMKernel, EpiSwiGLUT>", 3.0), ("engine_kernel<VarlenMKernel, EpiStore>", 1.0),
        ("gather_sum_kernel", 0.5), ("engine_kernel<VarlenMKernel, EpiDSwiGLUT>", 2.0),
        ("engine_kernel<VarlenKKernel, EpiStoreTma>", 1.5), ("engine_kernel<VarlenKKernel, EpiStoreTma>", 1.25),
        ("engine_kernel<VarlenKKernel, EpiStoreTma>", 1.25), ("engine_kernel<VarlenMKernel, EpiStore>", 2.5))]
    # our dW1 in two launches (separate gate / up weights) counts once
    assert spr.gemm_roles(ours, spr.OURS_GEMM_ORDER) == {
        "up-proj": 3.0, "down-proj": 1.0, "dA'": 2.0, "dW2": 1.5, "dW1": 2.5, "dX~": 2.5}
    same = "quackgemm_default_epiGemmDefaultSm90_coop"
    sonic = [{"name": n, "ms": ms} for n, ms in (
        ("quackgemm_actGemmGatedSm90", 2.0), (same, 1.0), ("token_gather_sum_kernel", 0.4),
        ("quackgemm_dactGemmDGatedSm90", 2.0), (same, 1.0), ("quackgemm_default_pp", 2.0), (same, 2.0))]
    assert spr.gemm_roles(sonic, spr.SONIC_GEMM_ORDER) == {
        "up-proj": 2.0, "down-proj": 1.0, "dA'": 2.0, "dW2": 1.0, "dX~": 2.0, "dW1": 2.0}
    assert spr.gemm_roles(sonic[:-1], spr.SONIC_GEMM_ORDER) is None  # a GEMM missing: no guess
    doc = {"configs": {"c": {"ours": {"sum_ms": 1, "kernels": ours, "sequence": ours},
                             "sonicmoe": {"sum_ms": 1, "kernels": sonic, "sequence": sonic}}}}
    text = spr.report(doc)
    assert "| dW1 | 2.500 | 2.000 | 0.80 |" in text and "| dX~ | 2.500 | 2.000 | 0.80 |" in text
    del doc["configs"]["c"]["sonicmoe"]["sequence"]  # an older profile.json: the role table only
    assert "Per GEMM" not in spr.report(doc)


def test_routing_split_by_job():
    ours = [{"name": n, "ms": ms} for n, ms in (
        ("void smoe::topk_softmax_kernel<float, 8>", 0.08), ("smoe::routing::router_backward_kernel<8>", 0.01),
        ("smoe::count_keys_kernel", 0.005), ("smoe::scatter_entries_kernel", 0.02), ("engine_kernel<EpiStore>", 1.0))]
    sonic = [{"name": n, "ms": ms} for n, ms in (
        ("kernel_cutlass_kernel_sonicmoefunctionaltopkSoftmax_Over_TopK_object", 0.02),
        ("_softmax_over_topk_bwd_kernel", 0.02), ("quackgemm_default", 1.0))]
    assert spr.routing_parts(ours) == {"router backward": 0.01, "top-K softmax": 0.08,
                                       "grouping (counts, order)": 0.025}
    doc = {"configs": {"c": {"ours": {"sum_ms": 1.1, "kernels": ours},
                             "sonicmoe": {"sum_ms": 1.04, "kernels": sonic}}}}
    text = spr.report(doc)
    assert "| top-K softmax | 0.080 | 0.020 | 0.25 |" in text
    assert "| router backward | 0.010 | 0.020 | 2.00 |" in text
    assert "| grouping (counts, order) | 0.025 | 0.000 | 0.00 |" in text
