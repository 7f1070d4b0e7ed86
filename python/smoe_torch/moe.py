"""Drop-in MoE module with torchtitan's parameter names and shapes.

torchtitan's MoE keeps `router.gate.weight` [E, d], `experts.w1` (gate) [E, n, d],
`experts.w2` [E, d, n] and `experts.w3` (up) [E, n, d]; its state dicts load unchanged here.
The kernels take gate and up interleaved by row ([E, 2n, d], row 2j gate j, row 2j+1 up j). By
default w1 and w3 are dense parameters and go to the kernels as two tensors (the ops' w3), without
a stack; with pack_gate_up=True they are the two halves of one [E, n, 2, d] storage (packing.py),
so that operand is a view of them (no per-step copy when they are bf16; fused optimizers refuse
such strided parameters). Only the EP path stacks them once per step.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _C, _layout  # noqa: F401  (_C: torch.ops.smoe.*; the package's _ops registered their fakes,
#                               autograd and the Python ops saved_expert_frequency / count_tokens_once first)
from .packing import GroupedExperts, PackedGateUp  # noqa: F401  (GroupedExperts: the public name stays here)

ops = torch.ops.smoe
ROUNDING_MODES = {"nr": 0, "up": 1, "down": 2, "sr": 3}


def moe_forward_interleaved(x, w_router, w1_interleaved, w2, top_k):
    """out = MoE(x) with the library's layouts; differentiable in x and all weights."""
    out, _saved = torch.ops.smoe.moe_forward(x, w_router, w1_interleaved, w2, top_k)
    return out


def check_routing(expert, num_experts):
    """Host-side check of caller-provided routing ids (one device sync): ids in [-1, E) and no expert
    twice in a token. The kernels also check on the device (without a sync): a bad slot is dropped
    and flagged in nonfinite_status(); this raises instead, naming the first bad token."""
    bad = (expert < -1) | (expert >= num_experts)
    if bool(bad.any()):
        t = int(bad.any(dim=1).nonzero()[0, 0])
        raise ValueError(f"smoe: expert ids must be in [-1, {num_experts}); token {t} has {expert[t].tolist()}")
    srt = expert.sort(dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if bool(dup.any()):
        t = int(dup.any(dim=1).nonzero()[0, 0])
        raise ValueError(f"smoe: token {t} lists an expert twice: {expert[t].tolist()}")


def moe_routed(x, w1_interleaved, w2, expert, scores, validate=True, w3=None):
    """out[t] = sum over t's slots k with expert[t,k] >= 0 of scores[t,k] * SwiGLU expert(x[t]).

    Any router written in torch trains through this: gradients flow to x (expert path), the
    weights and `scores` (so to the router through the caller's own autograd graph). expert
    [T, K] int (-1 = empty slot), scores [T, K] float. validate=True checks the ids on the host
    (one sync); with validate=False bad ids are dropped on the device and flagged. w3 given: gate/up
    as two tensors, w1 (gate) and w3 (up) [E, n, d] (w1_interleaved is then the gate)."""
    expert = expert.to(torch.int32).contiguous()
    if validate:
        check_routing(expert, w1_interleaved.shape[0])
    out, _saved = ops.moe_forward_routed(x, w1_interleaved, w2, expert, scores.float().contiguous(), w3)
    return out


def moe_token_rounding(x, w_router, w1_interleaved, w2, top_k, rounding="nr", seed=0):
    """The top-K softmax layer with SonicMoE token rounding of every expert's rows to the GEMM tile."""
    out, _saved = ops.moe_forward_tr(x, w_router, w1_interleaved, w2, top_k, ROUNDING_MODES[rounding], seed)
    return out


class _Fp32Logits(torch.autograd.Function):
    """logits = x w^T with bf16 inputs and an fp32 output (cuBLAS accumulates in fp32 either way; this
    keeps the fp32 result instead of rounding it to bf16), as the library's fused router does.
    Backward as the fused router's: dlogits rounded to bf16, dx = dl w, dw = dl^T x (bf16)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gb = g.to(x.dtype)
        return gb @ w, gb.t() @ x


def router_logits(x, w, fp32=True):
    """[T, E] router logits from bf16 x [T, d] and w [E, d]: fp32 (not bf16-rounded) when fp32 and
    on CUDA (torch.mm's out_dtype is CUDA-only); else F.linear in x's dtype."""
    w = w.to(x.dtype)
    if fp32 and x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2:
        return _Fp32Logits.apply(x, w)
    logits = F.linear(x, w)
    return logits.float() if fp32 else logits


class TokenChoiceTopKRouter(nn.Module):
    """torchtitan's router options (same names): score_func "softmax" | "sigmoid"; route_norm
    (renormalise the K chosen scores); route_scale; num_expert_groups / num_limited_groups
    (group-limited top-K, DeepSeek-V3: groups ranked by the sum of their top-2 scores)."""

    def __init__(self, dim, num_experts, top_k, score_func="softmax", route_norm=True, route_scale=1.0,
                 num_expert_groups=None, num_limited_groups=None):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid' (got {score_func!r})")
        if num_expert_groups is not None:
            if num_experts % num_expert_groups != 0:
                raise ValueError(f"num_experts = {num_experts} must be a multiple of num_expert_groups = "
                                 f"{num_expert_groups}")
            if not (1 <= (num_limited_groups or 0) <= num_expert_groups):
                raise ValueError("num_limited_groups must be in [1, num_expert_groups]")
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.num_expert_groups, self.num_limited_groups = num_expert_groups, num_limited_groups

    def fused(self):
        """True when the library's own router computes exactly this (softmax over the K chosen)."""
        return (self.score_func == "softmax" and self.route_norm and self.route_scale == 1.0
                and self.num_expert_groups is None)

    def forward(self, x, expert_bias=None, bf16_logits=False):
        """(expert [T,K] int32, scores [T,K] float32, full scores [T,E]) in torch, differentiable in
        the scores. expert_bias [E] shifts the selection only (auxiliary-loss-free balancing)."""
        logits = router_logits(x, self.gate.weight, fp32=not bf16_logits)
        scores = logits.softmax(-1) if self.score_func == "softmax" else torch.sigmoid(logits)
        scores = scores.float()
        sel = scores.detach() if expert_bias is None else scores.detach() + expert_bias
        if self.num_expert_groups is not None:
            T, E = sel.shape
            g = sel.view(T, self.num_expert_groups, -1).topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(g).scatter_(1, g.topk(self.num_limited_groups, dim=-1).indices, 1.0)
            sel = sel.masked_fill(keep.repeat_interleave(E // self.num_expert_groups, dim=1) == 0, float("-inf"))
        idx = sel.topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        if self.route_norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx.to(torch.int32), w * self.route_scale, scores


class SharedExperts(PackedGateUp):
    """Always-on SwiGLU experts (DeepSeek / Qwen-MoE shared experts), torchtitan's FeedForward names:
    w1 (gate) [h, d], w2 [d, h], w3 (up) [h, d] as nn.Linear weights, h = hidden_dim * count. Runs on
    the same kernels as a one-expert MoE every token is routed to with score 1."""

    def __init__(self, dim, hidden_dim, pack_gate_up=False):
        super().__init__()
        self.pack_gate_up = bool(pack_gate_up)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self._repack()
        self._register_repack_hook()

    def _gate_up(self):
        return self.w1.weight, self.w3.weight

    def init_weights(self, std=0.02):
        for lin in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=std)

    def forward(self, x2):
        w1, w3 = self.gate_up_operands(x2.dtype)
        w1 = w1.unsqueeze(0)  # [1, 2h, d] interleaved, or the gate [1, h, d] with w3
        w3 = w3.unsqueeze(0) if w3 is not None else None
        w2 = self.w2.weight.to(x2.dtype).unsqueeze(0)
        T = x2.shape[0]
        expert = torch.zeros(T, 1, dtype=torch.int32, device=x2.device)
        ones = torch.ones(T, 1, dtype=torch.float32, device=x2.device)
        out, _saved = ops.moe_forward_routed(x2, w1, w2, expert, ones, w3)
        return out


def _check_module_args(dim, hidden_dim, num_experts, top_k, aux_loss_coef, load_balance_coeff, num_shared_experts):
    """The library's shape rules (moe_can_implement), checked when the module is built, not at its first call."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)
    if not is_int(dim) or dim <= 0 or dim % 64 != 0:
        raise ValueError(f"MoE: dim = {dim!r} must be a positive multiple of 64")
    if not is_int(hidden_dim) or hidden_dim <= 0 or hidden_dim % 64 != 0:
        raise ValueError(f"MoE: hidden_dim = {hidden_dim!r} must be a positive multiple of 64")
    if not is_int(num_experts) or not 1 <= num_experts <= 512:
        raise ValueError(f"MoE: num_experts = {num_experts!r} must be in [1, 512]")
    if not is_int(top_k) or not 1 <= top_k <= min(num_experts, 16):
        raise ValueError(f"MoE: top_k = {top_k!r} must be in [1, min(num_experts, 16)] = [1, {min(num_experts, 16)}]")
    if not aux_loss_coef >= 0:
        raise ValueError(f"MoE: aux_loss_coef = {aux_loss_coef!r} must be >= 0")
    if load_balance_coeff is not None and not load_balance_coeff >= 0:
        raise ValueError(f"MoE: load_balance_coeff = {load_balance_coeff!r} must be None or >= 0")
    if not is_int(num_shared_experts) or num_shared_experts < 0:
        raise ValueError(f"MoE: num_shared_experts = {num_shared_experts!r} must be an integer >= 0")


class MoE(nn.Module):
    """Token-choice top-K MoE with SwiGLU experts on the smoe kernels (bf16 compute).

    Args:
        dim: hidden size d (multiple of 64); hidden_dim: expert size n (multiple of 64);
        num_experts: E (<= 512); top_k: K (<= 16, <= E);
        score_func, route_norm, route_scale, num_expert_groups, num_limited_groups: the router
            (TokenChoiceTopKRouter, torchtitan's names). The default (softmax, renormalised over the
            K chosen) runs the library's fused router; every other choice routes in torch and runs
            the experts through caller-provided routing (moe_routed), gradients included.
        load_balance_coeff: if not None, keep an `expert_bias` buffer (selection only) and count
            `tokens_per_expert` (in training, once per forward: an activation-checkpointing recompute
            does not count again); call update_expert_bias() after the optimizer step (DeepSeek-V3's
            auxiliary-loss-free balancing). The counts are summed over `dp_group` first (default:
            the default process group when torch.distributed is initialised), so every
            data-parallel rank makes the same update. Both buffers are fp32 and stay fp32 when the
            module is cast (`.to(torch.bfloat16)`, `.half()`), following its device moves.
        token_rounding: None or "nr" | "up" | "down" | "sr" (SonicMoE TR, fused router only).
        num_shared_experts: > 0 adds `shared_experts` (SharedExperts, hidden hidden_dim * count),
            applied to every token and added to the routed output.
        pack_gate_up: keep w1 / w3 (routed and shared) as the two halves of one interleaved storage,
            so bf16 parameters reach the kernels with no per-step copy (packing.py). Off by default:
            the halves are not dense, and torch's fused optimizers (AdamW(fused=True)) refuse them.
        bf16_logits: take top-K of bf16 logits (torchtitan / SonicMoE under autocast); routes in torch.
        ep_group: a smoe_torch.ep.EpGroup (expert parallelism over the GPUs of one node): the module
            then holds only this rank's num_experts / R experts (`experts`, global expert
            e = rank * E/R + local index), routes in torch (replicated router) and runs the experts
            through smoe_torch.ep.ep_moe. Every rank calls forward/backward in the same order. The
            router's gradient is per rank: all-reduce it over the group (DDP / FSDP does); the experts'
            gradients are local and must not be averaged over the EP group.
        ep_mesh: with ep_group, a 1-D DeviceMesh over the same ranks (in the same order): the experts
            are then DTensors of global shape [E, ...], Shard(0) (GroupedExperts), so DCP saves and
            loads every expert ([E, ...], at any EP size or in one process) and
            smoe_torch.ep_a2a.clip_grad_norm_ clips over all experts' gradients (torch's sees only a
            plain Parameter's local shard, and raises on a mix of plain and DTensor gradients).
        aux_loss_coef: if > 0, `self.aux_loss` holds coef * E * sum_e f_e P_e after each forward
            (f_e: fraction of routed rows at expert e, P_e: mean router probability), the
            Switch-Transformer load-balancing loss. With torch routing f comes from the routing
            itself; with the fused router it costs one more router GEMM and top-K in torch.
    Input [..., d]; parameters may be fp32 (cast to bf16 for the kernels) or bf16.
    """

    def __init__(self, dim, hidden_dim, num_experts, top_k, aux_loss_coef=0.0, score_func="softmax",
                 route_norm=True, route_scale=1.0, num_expert_groups=None, num_limited_groups=None,
                 load_balance_coeff=None, token_rounding=None, bf16_logits=False, rounding_seed=0,
                 num_shared_experts=0, ep_group=None, dp_group=None, pack_gate_up=False, ep_mesh=None):
        super().__init__()
        _check_module_args(dim, hidden_dim, num_experts, top_k, aux_loss_coef, load_balance_coeff, num_shared_experts)
        if token_rounding not in (None, "nr", "up", "down", "sr"):
            raise ValueError(f"token_rounding must be None, 'nr', 'up', 'down' or 'sr' (got {token_rounding!r})")
        self.ep_group = ep_group
        if ep_group is not None:
            if (ep_group.E, ep_group.d, ep_group.n, ep_group.K) != (num_experts, dim, hidden_dim, top_k):
                raise ValueError(f"ep_group was created for E, d, n, K = {(ep_group.E, ep_group.d, ep_group.n, ep_group.K)}, "
                                 f"the module has {(num_experts, dim, hidden_dim, top_k)}")
            if token_rounding is not None:
                raise ValueError("token_rounding is not available with ep_group (the EP layer takes the router's choice)")
        if ep_mesh is not None:
            if ep_group is None:
                raise ValueError("ep_mesh needs ep_group (the mesh places the EP group's experts)")
            if ep_mesh.ndim != 1 or ep_mesh.size() != ep_group.world:
                raise ValueError(f"ep_mesh must be 1-D over the ep_group's {ep_group.world} ranks (got shape "
                                 f"{tuple(ep_mesh.shape)})")
            # The whole rank list, not only this process's place: the same answer on every rank, so a
            # mismatch fails everywhere instead of hanging the ranks that passed.
            ranks = getattr(ep_group, "ranks", None)
            if ranks is not None and [int(r) for r in ep_mesh.mesh.flatten().tolist()] != list(ranks):
                raise ValueError(f"ep_mesh lists ranks {ep_mesh.mesh.flatten().tolist()}, ep_group {list(ranks)}: "
                                 f"the mesh must list the group's ranks in its order")
            if ep_mesh.get_local_rank() != ep_group.rank:
                raise ValueError(f"ep_mesh puts this process at {ep_mesh.get_local_rank()}, ep_group at {ep_group.rank}: "
                                 f"the mesh must list the group's ranks in its order")
        self.dim, self.hidden_dim, self.num_experts, self.top_k = dim, hidden_dim, num_experts, top_k
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k, score_func, route_norm, route_scale,
                                            num_expert_groups, num_limited_groups)
        # EP: this rank holds global experts [rank * E/P, (rank + 1) * E/P) (smoe_torch.ep), and each is
        # initialised by its global index (packing.init_experts_), as in the one-GPU module.
        self.experts = GroupedExperts(dim, hidden_dim, num_experts if ep_group is None else ep_group.experts_per_rank,
                                      pack_gate_up, mesh=ep_mesh,
                                      first_expert=None if ep_group is None else ep_group.rank * ep_group.experts_per_rank)
        self.aux_loss_coef = aux_loss_coef
        self.aux_loss = None
        if token_rounding is not None and (not self.router.fused() or bf16_logits):
            raise ValueError("token_rounding needs the fused router (softmax, route_norm, no groups, fp32 logits)")
        self.token_rounding, self.bf16_logits, self.rounding_seed = token_rounding, bf16_logits, rounding_seed
        self.load_balance_coeff = load_balance_coeff
        self.dp_group = dp_group
        if load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True)
            self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        else:
            self.expert_bias = None
        self.shared_experts = SharedExperts(dim, hidden_dim * num_shared_experts, pack_gate_up) if num_shared_experts > 0 else None
        self.init_weights()

    _FP32_BUFFERS = ("expert_bias", "tokens_per_expert")

    def _apply(self, fn, *args, **kwargs):
        """Module.to / .cuda / .bfloat16 / ...: expert_bias and tokens_per_expert follow device moves but
        stay fp32 under dtype casts (bf16 would count exactly only up to 256 and round small bias
        updates away). A cast buffer is replaced by the original fp32 values on the new device."""
        before = {k: self._buffers[k] for k in self._FP32_BUFFERS if self._buffers.get(k) is not None}
        out = super()._apply(fn, *args, **kwargs)
        for k, b in before.items():
            moved = self._buffers[k]
            if moved is not None and moved.dtype != torch.float32:
                src = b if b.dtype == torch.float32 else moved  # the uncast values where there are some
                self._buffers[k] = src.to(device=moved.device, dtype=torch.float32)
        return out

    def init_weights(self, std=0.02):
        nn.init.trunc_normal_(self.router.gate.weight, mean=0.0, std=std)
        self.experts.init_weights(std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std)

    @torch.no_grad()
    def update_expert_bias(self):
        """expert_bias += coeff * sign(mean load - load) over the tokens counted since the last call."""
        if self.load_balance_coeff is None:
            return
        tpe = self.tokens_per_expert
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(tpe, group=self.dp_group)  # the same counts, so the same bias, on every rank
        self.expert_bias.add_(self.load_balance_coeff * torch.sign(tpe.mean() - tpe))
        self.expert_bias.sub_(self.expert_bias.mean())
        tpe.zero_()

    def forward(self, x):
        if x.dim() == 0 or x.shape[-1] != self.dim:
            raise ValueError(f"MoE: x's last dimension is {tuple(x.shape)[-1:] or '()'} but this module has dim = "
                             f"{self.dim} (x must be [..., {self.dim}])")
        if not self.training:
            self.aux_loss = None  # evaluation adds no loss and counts nothing
        shape = x.shape
        x2 = x.reshape(-1, self.dim).to(torch.bfloat16).contiguous()
        # The kernels' gate/up operands with no copy: the interleaved view of the packed pair, else the
        # two tensors as they are (FSDP's unsharded params, torch.compile, hand-set params); EP takes
        # the interleaved layout only.
        if self.ep_group is not None:
            w1, w3 = self.experts.interleaved_w1(torch.bfloat16), None
        else:
            w1, w3 = self.experts.gate_up_operands(torch.bfloat16)
        w2 = self.experts.w2_operand(torch.bfloat16)
        torch_routing = (not self.router.fused() or self.bf16_logits or self.expert_bias is not None
                         or self.ep_group is not None)
        if torch_routing:
            idx, sc, probs = self.router(x2, self.expert_bias, self.bf16_logits)
            if self.ep_group is not None:
                from .ep import ep_moe
                out = ep_moe(self.ep_group, x2, idx, sc, w1, w2)
            else:
                out = moe_routed(x2, w1, w2, idx, sc, validate=False, w3=w3)
            if self.training and (self.expert_bias is not None or self.aux_loss_coef > 0):
                counts = torch.bincount(idx.reshape(-1).long(), minlength=self.num_experts).float()
                if self.expert_bias is not None:  # not again in a checkpoint's recompute (which runs in backward)
                    ops.count_tokens_once(self.tokens_per_expert, counts)
                if self.aux_loss_coef > 0:
                    f = counts / max(idx.numel(), 1)
                    self.aux_loss = self.aux_loss_coef * self.num_experts * (f * probs.mean(dim=0)).sum()
        else:
            wr = self.router.gate.weight.to(torch.bfloat16)
            if self.token_rounding is not None and self.training:  # evaluation is top-K (SonicMoE's TR)
                mode = ROUNDING_MODES[self.token_rounding]
                out, saved = ops.moe_forward_tr(x2, wr, w1, w2, self.top_k, mode, self.rounding_seed, w3)
                router, rounding = _layout.ROUTER_TOKEN_ROUNDING, mode
            else:
                out, saved = ops.moe_forward(x2, wr, w1, w2, self.top_k, w3)
                router, rounding = _layout.ROUTER_TOPK_SOFTMAX, 0
            if self.aux_loss_coef > 0 and self.training:
                # f from the routing's own counts (no second top-K); P needs the softmax over E.
                T = x2.shape[0]
                counts = ops.saved_expert_frequency(saved, T, self.dim, self.hidden_dim, self.num_experts,
                                                    self.top_k, router, rounding).float()
                f = counts / max(T * self.top_k, 1)
                probs = router_logits(x2, wr).softmax(dim=-1)
                self.aux_loss = self.aux_loss_coef * self.num_experts * (f * probs.mean(dim=0)).sum()
        if self.shared_experts is not None:
            out = out + self.shared_experts(x2)
        return out.reshape(shape).to(x.dtype)
