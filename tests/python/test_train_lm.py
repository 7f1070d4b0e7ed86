"""examples/train_lm/train_lm.py on the CPU: the torchtitan-pattern MoE against a per-token loop
(forward and gradients, float32), the same init in every variant, and the --cpu-smoke run end to end
(data, model, module-time breakdown, budget stop, JSON and plot). No GPU and no built extension
needed: the smoe and sonicmoe variants are recorded as skipped with their reason.
Run:  /work/venv-torch/bin/python -m pytest -q tests/python/test_train_lm.py
"""
import importlib.util
import json
import math
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_lm" / "train_lm.py"
_spec = importlib.util.spec_from_file_location("train_lm", SCRIPT)
tl = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tl
_spec.loader.exec_module(tl)


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def naive_moe(x, gate, w1, w2, w3, K, shared=None):
    """One token and one slot at a time: softmax over all E, top-K, renormalised over the K,
    out[t] = sum_k s[t,k] * W2_e (silu(W1_e x) * W3_e x) (+ the shared SwiGLU expert)."""
    outs = []
    for xt in x:
        p = torch.softmax(gate @ xt, dim=-1)
        s, idx = p.topk(K)
        s = s / s.sum()
        acc = torch.zeros_like(xt)
        for k in range(K):
            e = int(idx[k])
            acc = acc + s[k] * (w2[e] @ (F.silu(w1[e] @ xt) * (w3[e] @ xt)))
        if shared is not None:
            g, d, u = shared
            acc = acc + d @ (F.silu(g @ xt) * (u @ xt))
        outs.append(acc)
    return torch.stack(outs)


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
@pytest.mark.parametrize("shared", [0, 1])
def test_torchtitan_moe_matches_per_token_loop(monkeypatch, impl, shared):
    if impl == "grouped_mm" and not tl._probe_grouped_mm(torch.device("cpu"), torch.float32):
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    monkeypatch.setitem(tl._GMM_OK, ("cpu", torch.float32), impl == "grouped_mm")
    torch.manual_seed(7)
    d, n, E, K = 32, 16, 6, 2
    m = tl.TorchtitanMoE(d, n, E, K, shared=shared, compute_dtype=torch.float32)
    with torch.no_grad():  # fresh random weights, large enough that every term matters
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    x = torch.randn(3, 11, d, requires_grad=True)
    dout = torch.randn(3, 11, d)
    out = m(x)
    (out * dout).sum().backward()
    names = [nm for nm, _ in m.named_parameters()]
    got = [out.detach(), x.grad] + [p.grad for p in m.parameters()]

    leaves = {nm: p.detach().clone().requires_grad_(True) for nm, p in m.named_parameters()}
    xr = x.detach().clone().requires_grad_(True)
    sh = None
    if shared:
        sh = tuple(leaves[f"shared_experts.{w}.weight"] for w in ("w1", "w2", "w3"))
    ref = naive_moe(xr.reshape(-1, d), leaves["router.gate.weight"], leaves["experts.w1"], leaves["experts.w2"],
                    leaves["experts.w3"], K, sh).reshape(x.shape)
    (ref * dout).sum().backward()
    want = [ref.detach(), xr.grad] + [leaves[nm].grad for nm in names]
    for what, g, w in zip(["out", "dx"] + names, got, want):
        assert g is not None and g.shape == w.shape, what
        assert rel_l2(g, w) < 1e-5, f"{what}: rel L2 {rel_l2(g, w):.2e}"


def _args(**kw):
    base = dict(layers=2, dim=64, heads=2, experts=4, top_k=2, hidden=64, shared=1, seq=16, compile=False)
    base.update(kw)
    return SimpleNamespace(**base)


def test_same_init_in_every_variant():
    """The torchtitan pattern and the SonicMoE wrapper (built without sonicmoe) share names, shapes and
    the init values of one seed; both use smoe_torch.MoE's names and shapes."""
    a = _args()
    models = {
        "torchtitan": tl.LM(a, lambda: tl.TorchtitanMoE(a.dim, a.hidden, a.experts, a.top_k, a.shared), torch.float32),
        "sonicmoe": tl.LM(a, lambda: tl.SonicMoE(None, a.dim, a.hidden, a.experts, a.top_k, a.shared), torch.float32),
    }
    infos = {k: tl.init_params(m, 3, a.layers) for k, m in models.items()}
    assert infos["torchtitan"] == infos["sonicmoe"]
    sd = {k: m.state_dict() for k, m in models.items()}
    assert sd["torchtitan"].keys() == sd["sonicmoe"].keys()
    for k, v in sd["torchtitan"].items():
        assert torch.equal(v, sd["sonicmoe"][k]), k
    E, n, d = a.experts, a.hidden, a.dim
    # smoe_torch.MoE's parameters (python/smoe_torch/moe.py, packing.py): torchtitan's names and shapes
    want = {"router.gate.weight": (E, d), "experts.w1": (E, n, d), "experts.w2": (E, d, n), "experts.w3": (E, n, d),
            "shared_experts.w1.weight": (n, d), "shared_experts.w2.weight": (d, n), "shared_experts.w3.weight": (n, d)}
    pre = "blocks.0.moe."
    got = {k[len(pre):]: tuple(v.shape) for k, v in sd["torchtitan"].items() if k.startswith(pre)}
    assert got == want
    try:
        import smoe_torch
    except Exception:  # noqa: BLE001  (not built on the CPU machine)
        return
    if not hasattr(smoe_torch, "MoE"):  # another test's stand-in package (the drop-ins' tests without _C)
        return
    m = smoe_torch.MoE(d, n, E, a.top_k, num_shared_experts=a.shared)
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == want
    b = tl.init_params(tl.LM(a, lambda: tl.make_smoe(smoe_torch, a, None), torch.float32), 3, a.layers)
    assert b == infos["torchtitan"]


def test_module_timer_sees_every_module():
    a = _args(shared=0)
    model = tl.LM(a, lambda: tl.TorchtitanMoE(a.dim, a.hidden, a.experts, a.top_k, 0, torch.float32), torch.float32)
    timer = tl.ModuleTimer(tl.Clock(torch.device("cpu")),
                           {"attention": [b.attn for b in model.blocks], "moe": [b.moe for b in model.blocks]})
    timer.attach()
    x = torch.randint(0, 256, (2, a.seq))
    model(x, x).backward()
    assert not timer.open  # every start found its stop, forward and backward
    assert sorted(k for k, _, _ in timer.spans) == sorted(
        [f"{c}_{p}" for c in ("attention", "moe") for p in ("fwd", "bwd")] * a.layers)
    t = timer.collect()
    assert all(v > 0 for v in t.values()), t
    timer.detach()
    model(x, x).backward()
    assert not timer.spans  # detached: nothing recorded


def _smoke(tmp_path, *extra):
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc


def test_cpu_smoke_json(tmp_path):
    doc, proc = _smoke(tmp_path, "--shared", "1", "--plot", str(tmp_path / "smoke.png"))
    for key in ("commit", "device", "torch", "config", "corpus", "runs", "summary", "plot"):
        assert key in doc, key
    c = doc["config"]
    assert (c["layers"], c["dim"], c["experts"], c["top_k"], c["seq"], c["shared"]) == (2, 64, 4, 2, 32, 1)
    assert c["tokens_per_step"] == c["batch"] * c["seq"] and c["vocab"].startswith("byte-level")
    assert doc["corpus"]["files"] > 100 and doc["corpus"]["heldout_bytes"] > 0
    runs = {r["variant"]: r for r in doc["runs"]}
    assert set(runs) == {"smoe", "torchtitan", "sonicmoe"}
    assert runs["smoe"]["status"] == "skipped" and runs["smoe"]["reason"]
    assert runs["sonicmoe"]["status"] == "skipped"
    try:
        import sonicmoe  # noqa: F401
    except Exception:  # noqa: BLE001
        assert runs["sonicmoe"]["reason"].startswith("sonicmoe does not import: ")
    r = runs["torchtitan"]
    assert r["status"] == "done" and r["steps_done"] == c["steps"], r
    assert r["timed_steps"] == c["steps"] - c["warmup_steps"] - c["profile_steps"]
    assert r["tokens_per_s"] > 0 and math.isclose(r["tokens_per_day"], 86400 * r["tokens_per_s"])
    assert r["step_ms_p10"] <= r["step_ms_median"] <= r["step_ms_p90"]
    bd = r["breakdown_ms"]
    for k in ("attention_fwd", "attention_bwd", "moe_fwd", "moe_bwd", "optimizer", "step", "rest"):
        assert k in bd and bd[k] >= 0, (k, bd)
    assert bd["attention_fwd"] > 0 and bd["moe_bwd"] > 0
    assert math.isclose(sum(r["breakdown_fraction"].values()), 1.0, rel_tol=1e-6)
    assert [s for s, _ in r["train_loss"]] == list(range(1, c["steps"] + 1))
    assert all(math.isfinite(v) for _, v in r["train_loss"])
    assert abs(r["train_loss"][0][1] - math.log(256)) < 1.5  # starts near a uniform guess over 256 bytes
    assert [s for s, _ in r["eval_loss"]] == [c["eval_every"], c["steps"]]
    assert r["final_eval_loss"] == r["eval_loss"][-1][1] and math.isfinite(r["final_eval_loss"])
    assert r["grouped_mm"] in ("torch._grouped_mm", "per-expert loop")
    assert doc["summary"]["torchtitan"]["speedup_vs_torchtitan"] == 1.0
    if doc["plot"].startswith("skipped"):
        assert "matplotlib" in doc["plot"]
    else:
        assert (tmp_path / "smoke.png").stat().st_size > 0


def test_cpu_smoke_budget_stop(tmp_path):
    """--max-seconds 0: the run stops before its first step and still writes a well-formed record."""
    doc, _ = _smoke(tmp_path, "--variants", "torchtitan", "--max-seconds", "0", "--plot", "none")
    (r,) = doc["runs"]
    assert r["status"] == "stopped" and r["steps_done"] == 0 and "budget" in r["stop_reason"]
    assert r["tokens_per_s"] is None and r["train_loss"] == [] and math.isfinite(r["final_eval_loss"])
    assert "plot" not in doc and doc["summary"] == {}


# ---- on the GPU (skipped elsewhere): the smoe variants in the real script
def _smoe_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return pytest.importorskip("smoe_torch")


def test_gpu_smoe_under_autocast():
    """smoe_torch.MoE as the script builds it (fp32 master weights, unpacked gate/up) gives the same
    output with and without autocast, matches the float32 torchtitan pattern at the same weights and
    takes a fused AdamW step."""
    smoe_torch = _smoe_or_skip()
    a = _args(dim=256, hidden=128, experts=8, top_k=2, shared=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = tl.make_smoe(smoe_torch, a, None)
        ref = tl.TorchtitanMoE(a.dim, a.hidden, a.experts, a.top_k, 0, torch.float32)
    refp = dict(ref.named_parameters())
    with torch.no_grad():
        for nm, p in refp.items():  # router scores well apart (no near-ties between bf16 and fp32 logits)
            p.copy_(torch.randn_like(p) * (a.dim ** -0.5 if nm == "router.gate.weight" else 0.05))
        for nm, p in m.named_parameters():  # both bf16-rounded, as the kernels read them
            p.copy_(refp[nm].bfloat16().float())
            refp[nm].copy_(p)
    assert all(p.is_contiguous() for p in m.parameters())
    x = torch.randn(4, 64, a.dim, device="cuda").bfloat16()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_amp = m(x)
    out = m(x)
    assert out_amp.dtype == torch.bfloat16 and rel_l2(out_amp.float(), out.float()) < 1e-3  # same computation
    want = ref(x.float())
    assert rel_l2(out.float(), want) < 1e-2
    opt = torch.optim.AdamW(m.parameters(), fused=True)
    out_amp.float().square().mean().backward()
    opt.step()


def test_gpu_script_same_init(tmp_path):
    """The script on the GPU with a small model: every variant runs, and smoe and torchtitan start from
    the same weights (same names, shapes and init checksum)."""
    _smoe_or_skip()
    out = tmp_path / "gpu.json"
    doc = tl.main(["--variants", "smoe,smoe_tr,torchtitan", "--layers", "2", "--dim", "128", "--heads", "2",
                   "--experts", "8", "--top-k", "2", "--hidden", "64", "--seq", "64", "--batch", "4", "--steps", "8",
                   "--warmup-steps", "2", "--profile-steps", "2", "--eval-every", "4", "--eval-batches", "1",
                   "--out", str(out), "--plot", "none"])
    runs = {r["variant"]: r for r in doc["runs"]}
    for v, r in runs.items():
        assert r["status"] == "done", (v, r.get("error"), r.get("traceback"))
        assert r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0 and math.isfinite(r["final_eval_loss"])
        assert r["breakdown_ms"]["moe_fwd"] > 0 and r["breakdown_ms"]["moe_bwd"] > 0
    assert runs["smoe"]["init"] == runs["torchtitan"]["init"] == runs["smoe_tr"]["init"]
    assert runs["smoe"]["smoe_nonfinite_status"][0] == 0
    assert runs["torchtitan"]["grouped_mm"] == "torch._grouped_mm"
