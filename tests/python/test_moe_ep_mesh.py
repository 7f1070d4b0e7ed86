"""smoe_torch.MoE(ep_group=..., ep_mesh=...): the one-node EP module's experts as Shard(0) DTensors on
the EP mesh, so DCP and gradient clipping see all E experts (issue 38 item 2).

CPU, 2 gloo processes, no extension: moe.py is loaded with a stub _C, and smoe_torch.ep.ep_moe (NCCL's
device API, 2 GPUs) is replaced by a pure-torch twin over gloo with autograd (every rank's tokens
gathered, this rank's experts applied, the partial outputs summed over the ranks). What is checked is
the module around ep_moe, which is the same code on the GPU:
  (1) forward and backward with ep_mesh bitwise equal to the plain-Parameter EP module from the same
      seed (out, dx, every router gradient), the expert grads Shard(0) DTensors whose local shards
      equal the plain module's grads, global shapes [E, ...];
  (2) smoe_torch.ep_a2a.clip_grad_norm_ over the replicated router + the DTensor experts equal to one
      process over all E experts' gradients (the plain module's torch clip sees half of them);
  (3) DCP saves [E, ...] at EP = 2, loads back into a fresh EP = 2 module, and loads with no process
      group into a single-GPU-shaped MoE state ([E, ...] = both ranks' shards in expert order).
Argument rules: ep_mesh without ep_group, a mesh of the wrong size, with pack_gate_up.
"""
import importlib
import os
import sys
import types

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_ep_a2a import ROOT, _lst, load_ep_a2a, rel, spawn2_ok  # noqa: E402  (the gloo helpers)

CFG = dict(T=8, d=64, n=64, E=4, K=2, max_norm=1e-3)
PKG = "smoe_moe_epmesh"


def ep_moe_twin(group, x, expert, scores, w1, w2):
    """smoe_torch.ep.ep_moe's contract over gloo, in torch: x [T, d] this rank's tokens, expert [T, K]
    global ids, scores [T, K], w1 [E/R, 2n, d] interleaved gate/up, w2 [E/R, d, n] this rank's experts.
    fp32 math; the output in x's dtype."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn
    rank, world = dist.get_rank(), dist.get_world_size()
    El = w1.shape[0]
    xs = torch.cat(dnn.all_gather(x.float()))
    ss = torch.cat(dnn.all_gather(scores.float()))
    ids = [torch.empty_like(expert) for _ in range(world)]
    dist.all_gather(ids, expert)
    ids = torch.cat(ids)
    y = torch.zeros_like(xs)
    for e in range(El):
        rows, slots = (ids == rank * El + e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        h = xs[rows] @ w1[e].float().t()
        a = torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]
        y = y.index_add(0, rows, (a @ w2[e].float().t()) * ss[rows, slots, None])
    y = dnn.all_reduce(y)
    T = x.shape[0]
    return y[rank * T:(rank + 1) * T].to(x.dtype)


def load_moe():
    """moe.py as a module of a stub package: _C is empty (not called on the EP path) and .ep's ep_moe
    is the twin above."""
    if PKG + ".moe" not in sys.modules:
        pkg = types.ModuleType(PKG)
        pkg.__path__ = [os.path.join(ROOT, "python", "smoe_torch")]
        stub, ep = types.ModuleType(PKG + "._C"), types.ModuleType(PKG + ".ep")
        ep.ep_moe = ep_moe_twin
        sys.modules[PKG], sys.modules[PKG + "._C"], sys.modules[PKG + ".ep"] = pkg, stub, ep
        pkg._C, pkg.ep = stub, ep
    return importlib.import_module(PKG + ".moe")


class FakeEpGroup:
    """The attributes MoE reads of smoe_torch.ep.EpGroup."""

    def __init__(self, rank, world, ranks=None):
        self.rank, self.world = rank, world
        self.ranks = list(range(world)) if ranks is None else ranks
        self.E, self.d, self.n, self.K = CFG["E"], CFG["d"], CFG["n"], CFG["K"]
        self.experts_per_rank = self.E // world


def _modules(moe, group, mesh, seed):
    """(plain, mesh) EP modules, fp32, from the same torch seed (so the same router and local experts)."""
    out = []
    for m in (None, mesh):
        torch.manual_seed(seed)
        out.append(moe.MoE(CFG["d"], CFG["n"], CFG["E"], CFG["K"], ep_group=group, ep_mesh=m))
    return out


def _worker(rank, world, port, ckpt, q):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = {}
    try:
        moe, ep_a2a = load_moe(), load_ep_a2a()
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        group = FakeEpGroup(rank, world)
        T, d = CFG["T"], CFG["d"]
        g = torch.Generator().manual_seed(97 + rank)
        x_in = torch.randn(T, d, generator=g)
        dout = torch.randn(T, d, generator=g)
        names = ("w1", "w2", "w3")

        # (1) one training step through both modules
        plain, dt = _modules(moe, group, mesh, 11)
        res["global_shapes"] = [list(getattr(dt.experts, k).shape) for k in names]
        res["local_shapes"] = [list(getattr(dt.experts, k).to_local().shape) for k in names]
        res["init_equal"] = all(torch.equal(getattr(plain.experts, k), getattr(dt.experts, k).to_local()) for k in names)
        outs = []
        for m in (plain, dt):
            x = x_in.clone().requires_grad_(True)
            out = m(x)
            out.backward(dout)
            outs.append([out.detach(), x.grad, m.router.gate.weight.grad])
        res["out_nonzero"] = outs[0][0].abs().sum().item() > 0
        res["fwd_bwd_bitwise"] = all(torch.equal(a, b) for a, b in zip(*outs))
        gd = [getattr(dt.experts, k).grad for k in names]
        res["grad_is_dtensor_shard0"] = all(isinstance(t, DTensor) and tuple(t.placements) == (Shard(0),) for t in gd)
        res["grad_local_bitwise"] = all(torch.equal(t.to_local(), getattr(plain.experts, k).grad)
                                        for t, k in zip(gd, names))
        res["expert_grads"] = {k: _lst(getattr(plain.experts, k).grad) for k in names}

        # (2) clipping: the router's grad averaged over the ranks (as DDP does), then the mixed clip
        for p in dt.router.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        res["router_grad"] = _lst(dt.router.gate.weight.grad)
        params = list(dt.parameters())
        res["total"] = ep_a2a.clip_grad_norm_(params, CFG["max_norm"]).item()
        res["post_local"] = {k: _lst(getattr(dt.experts, k).grad.to_local()) for k in names}

        # (3) DCP at EP = 2, then a fresh module restored from it
        dcp.save(dt.state_dict(), checkpoint_id=os.path.join(ckpt, "mesh"))
        fresh = _modules(moe, group, mesh, 12345)[1]
        res["fresh_differs"] = not torch.equal(fresh.experts.w1.to_local(), dt.experts.w1.to_local())
        dcp.load(fresh.state_dict(), checkpoint_id=os.path.join(ckpt, "mesh"))
        res["dcp_roundtrip_equal"] = all(torch.equal(a.to_local() if isinstance(a, DTensor) else a,
                                                     b.to_local() if isinstance(b, DTensor) else b)
                                         for a, b in zip(fresh.state_dict().values(), dt.state_dict().values()))
        res["shards"] = {k: _lst(getattr(dt.experts, k).to_local()) for k in names}
        res["router"] = _lst(dt.router.gate.weight)
    except Exception as ex:  # noqa: BLE001
        import traceback
        res["error"] = repr(ex) + traceback.format_exc()[-2500:]
    finally:
        q.put((rank, res))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("moe_ep_dcp"))
    return spawn2_ok(_worker, ckpt), ckpt


def test_mesh_module_step_bitwise_the_plain_module(results):
    E, n, d = CFG["E"], CFG["n"], CFG["d"]
    for rank, r in results[0]:
        assert r["init_equal"], f"rank {rank}: the mesh module's local experts differ from the plain one's"
        assert r["global_shapes"] == [[E, n, d], [E, d, n], [E, n, d]], r["global_shapes"]
        assert r["local_shapes"] == [[E // 2, n, d], [E // 2, d, n], [E // 2, n, d]], r["local_shapes"]
        assert r["out_nonzero"]
        assert r["fwd_bwd_bitwise"], f"rank {rank}: out / dx / drouter differ from the plain module"
        assert r["grad_is_dtensor_shard0"], f"rank {rank}: the expert grads are not Shard(0) DTensors"
        assert r["grad_local_bitwise"], f"rank {rank}: the grads' local shards differ from the plain module's"


def test_mesh_module_clip_matches_one_process(results):
    got = results[0]
    flat = lambda ts: torch.cat([torch.tensor(t, dtype=torch.float64).reshape(-1) for t in ts])  # noqa: E731
    router = got[0][1]["router_grad"]
    assert router == got[1][1]["router_grad"], "the router grads were not averaged to the same value"
    experts = [g for _, r in got for g in r["expert_grads"].values()]  # every expert once: both ranks' shards
    ref = flat([router] + experts).norm().item()
    assert ref > 10 * CFG["max_norm"], "the test must clip"
    coef = CFG["max_norm"] / (ref + 1e-6)
    assert got[0][1]["total"] == got[1][1]["total"], "the ranks clip with different norms"
    for rank, r in got:
        assert abs(r["total"] - ref) <= 1e-5 * ref, (rank, r["total"], ref)
        for k, pre in r["expert_grads"].items():
            assert rel(torch.tensor(r["post_local"][k]), torch.tensor(pre) * coef) <= 1e-5, (rank, k)
    # what the plain module's torch clip would use: this rank's experts only
    local_only = flat([router] + list(got[0][1]["expert_grads"].values())).norm().item()
    assert abs(local_only - ref) > 1e-3 * ref


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_mesh_module_dcp_global_and_single_process_load(results):
    import torch.distributed.checkpoint as dcp
    got, ckpt = results
    E, n, d = CFG["E"], CFG["n"], CFG["d"]
    for rank, r in got:
        assert r["fresh_differs"] and r["dcp_roundtrip_equal"], f"rank {rank}: the EP = 2 load did not restore"
    shapes = {"experts.w1": (E, n, d), "experts.w2": (E, d, n), "experts.w3": (E, n, d), "router.gate.weight": (E, d)}
    meta = dcp.FileSystemReader(os.path.join(ckpt, "mesh")).read_metadata().state_dict_metadata
    assert {k: tuple(meta[k].size) for k in shapes} == shapes
    # A single-process MoE's state (no EP: [E, ...] experts) loads it with no process group.
    moe = load_moe()
    one = moe.MoE(d, n, E, CFG["K"])
    sd = one.state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(ckpt, "mesh"), no_dist=True)
    one.load_state_dict(sd)
    for k in ("w1", "w2", "w3"):
        want = torch.cat([torch.tensor(r["shards"][k]) for _, r in got])
        assert torch.equal(getattr(one.experts, k).detach(), want), k
    assert torch.equal(one.router.gate.weight.detach(), torch.tensor(got[0][1]["router"]))


def test_ep_experts_are_the_one_gpu_modules_slice():
    """After the same torch seed, EP rank r's local experts are experts [r E/P, (r+1) E/P) of the one-GPU
    module (each initialised by its global index), so ranks differ and EP = P starts where EP = 1 does;
    the router too. Not with a generator per rank drawing the same values into every rank's experts."""
    moe = load_moe()
    d, n, E, K = CFG["d"], CFG["n"], CFG["E"], CFG["K"]
    torch.manual_seed(5)
    one = moe.MoE(d, n, E, K)
    El = E // 2
    for r in range(2):
        torch.manual_seed(5)
        ep = moe.MoE(d, n, E, K, ep_group=FakeEpGroup(r, 2))
        assert ep.experts.first_expert == r * El
        for k in ("w1", "w2", "w3"):
            assert torch.equal(getattr(ep.experts, k), getattr(one.experts, k)[r * El:(r + 1) * El]), (r, k)
        assert torch.equal(ep.router.gate.weight, one.router.gate.weight)
    assert not torch.equal(one.experts.w1[:El], one.experts.w1[El:])  # rank 0's experts are not rank 1's


def test_ep_mesh_argument_rules():
    moe = load_moe()

    class Mesh:  # the attributes the rules read
        def __init__(self, ndim, size, local, ranks=None):
            self.ndim, self.shape = ndim, (size,) * ndim
            self._size, self._local = size, local
            self.mesh = torch.tensor(list(range(size)) if ranks is None else ranks)

        def size(self):
            return self._size

        def get_local_rank(self):
            return self._local

    d, n, E, K = CFG["d"], CFG["n"], CFG["E"], CFG["K"]
    with pytest.raises(ValueError, match="ep_mesh needs ep_group"):
        moe.MoE(d, n, E, K, ep_mesh=Mesh(1, 2, 0))
    with pytest.raises(ValueError, match="ep_mesh must be 1-D"):
        moe.MoE(d, n, E, K, ep_group=FakeEpGroup(0, 2), ep_mesh=Mesh(1, 4, 0))
    with pytest.raises(ValueError, match="ep_mesh must be 1-D"):
        moe.MoE(d, n, E, K, ep_group=FakeEpGroup(0, 2), ep_mesh=Mesh(2, 2, 0))
    with pytest.raises(ValueError, match="in its order"):
        moe.MoE(d, n, E, K, ep_group=FakeEpGroup(1, 2), ep_mesh=Mesh(1, 2, 0))
    # Another set of global ranks (this process at the same place): every rank sees the mismatch.
    with pytest.raises(ValueError, match=r"lists ranks \[2, 3\], ep_group \[0, 1\]"):
        moe.MoE(d, n, E, K, ep_group=FakeEpGroup(0, 2), ep_mesh=Mesh(1, 2, 0, ranks=[2, 3]))
    with pytest.raises(ValueError, match="pack_gate_up is not available with a mesh"):
        moe.GroupedExperts(d, n, 2, pack_gate_up=True, mesh=Mesh(1, 2, 0))
