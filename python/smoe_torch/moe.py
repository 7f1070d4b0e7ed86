"""Drop-in MoE module with torchtitan's parameter names and shapes.

torchtitan's MoE keeps `router.gate.weight` [E, d], `experts.w1` (gate) [E, n, d],
`experts.w2` [E, d, n] and `experts.w3` (up) [E, n, d]; its state dicts load unchanged here.
The kernels take gate and up interleaved by row ([E, 2n, d], row 2j gate j, row 2j+1 up j), so
forward builds that view with one stack (autograd splits the gradient back into w1 / w3).
That copy costs E*2n*d*2 bytes of traffic per step; keeping the interleaved tensor as the
parameter (with state-dict hooks) would remove it and is left for later.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def moe_forward_interleaved(x, w_router, w1_interleaved, w2, top_k):
    """out = MoE(x) with the library's layouts; differentiable in x and all weights."""
    out, _saved = torch.ops.smoe.moe_forward(x, w_router, w1_interleaved, w2, top_k)
    return out


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim, num_experts, top_k):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = top_k


class GroupedExperts(nn.Module):
    def __init__(self, dim, hidden_dim, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def init_weights(self, std=0.02):
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=std)

    def interleaved_w1(self, dtype):
        E, n, d = self.w1.shape
        return torch.stack((self.w1.to(dtype), self.w3.to(dtype)), dim=2).reshape(E, 2 * n, d)


class MoE(nn.Module):
    """Token-choice top-K MoE with SwiGLU experts on the smoe kernels (bf16 compute).

    Args:
        dim: hidden size d (multiple of 64); hidden_dim: expert size n (multiple of 64);
        num_experts: E (<= 512); top_k: K (<= 16, <= E);
        aux_loss_coef: if > 0, `self.aux_loss` holds coef * E * sum_e f_e P_e after each forward
            (f_e: fraction of routed rows at expert e, P_e: mean router probability), the
            Switch-Transformer load-balancing loss; add it to the training loss. It costs one more
            router GEMM and a top-K in torch.
    Input [..., d]; parameters may be fp32 (cast to bf16 for the kernels) or bf16.
    """

    def __init__(self, dim, hidden_dim, num_experts, top_k, aux_loss_coef=0.0):
        super().__init__()
        self.dim, self.hidden_dim, self.num_experts, self.top_k = dim, hidden_dim, num_experts, top_k
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.aux_loss_coef = aux_loss_coef
        self.aux_loss = None
        self.init_weights()

    def init_weights(self, std=0.02):
        nn.init.trunc_normal_(self.router.gate.weight, mean=0.0, std=std)
        self.experts.init_weights(std)

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, self.dim).to(torch.bfloat16).contiguous()
        wr = self.router.gate.weight.to(torch.bfloat16)
        w1 = self.experts.interleaved_w1(torch.bfloat16)
        w2 = self.experts.w2.to(torch.bfloat16)
        out = moe_forward_interleaved(x2, wr, w1, w2, self.top_k)
        if self.aux_loss_coef > 0:
            logits = F.linear(x2, wr).float()
            probs = logits.softmax(dim=-1)
            chosen = logits.topk(self.top_k, dim=-1).indices.reshape(-1)
            f = torch.zeros(self.num_experts, device=x.device, dtype=torch.float32)
            f = f.index_add(0, chosen, torch.ones_like(chosen, dtype=torch.float32)) / chosen.numel()
            self.aux_loss = self.aux_loss_coef * self.num_experts * (f * probs.mean(dim=0)).sum()
        return out.reshape(shape).to(x.dtype)
