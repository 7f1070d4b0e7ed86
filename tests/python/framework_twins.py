"""Pure-torch twins of the training stacks' expert math, for tests where the real package is missing.

Each twin is a minimal transcription of the pinned version's code (cited per function); only the
grouped GEMM kernels are replaced by a per-expert loop of plain matmuls with the same operand
orientation. test_dropins.py compares every drop-in with the real framework module where it is
importable and with these twins otherwise. Also here: expert_major_twin, a float32 twin of
smoe_torch.expert_major (the signature of python/smoe_torch/expert_major.py), used when
smoe_torch.expert_major_ref cannot be imported.
"""
import torch
import torch.nn.functional as F
from torch import nn


# ---------------------------------------------------------------------------------------------
# smoe_torch.expert_major (the contract in docs/expert_major.md / include/smoe/expert_major.h)
# ---------------------------------------------------------------------------------------------
def expert_major_twin(x, counts, w1, w2, w3=None, *, probs=None, segment_offset=None, gate_up=None,
                      dtype=torch.float32):
    """out[r] = p[r] * W2_e (silu(G_e x[r]) * U_e x[r]) for the valid rows r of expert e, 0 for padding.

    Rows of expert e: [begin(e), begin(e) + counts[e]) with begin = exclusive prefix sum of counts, or
    segment_offset[e] when given; every other row is padding. gate_up: "interleaved" (w1 [E, 2n, d],
    rows 2j gate / 2j+1 up), "separate" (w1 gate, w3 up [E, n, d]), "concatenated" (w1 [E, 2n, d], rows
    [0, n) gate, [n, 2n) up); None: "separate" if w3 is given, else "interleaved". Computed in `dtype`
    from the given tensors (differentiable), returned in x's dtype.
    """
    if gate_up is None:
        gate_up = "separate" if w3 is not None else "interleaved"
    E = w1.shape[0]
    cnt = [int(c) for c in counts.tolist()]
    if segment_offset is not None:
        begin = [int(b) for b in segment_offset.tolist()[:E]]
    else:
        begin, acc = [], 0
        for c in cnt:
            begin.append(acc)
            acc += c
    xf = x.to(dtype)
    pieces, rows = [], []
    for e in range(E):
        if cnt[e] == 0:
            continue
        b = begin[e]
        xe = xf[b:b + cnt[e]]
        if gate_up == "separate":
            g, u = w1[e].to(dtype), w3[e].to(dtype)
        elif gate_up == "interleaved":
            g, u = w1[e, 0::2].to(dtype), w1[e, 1::2].to(dtype)
        elif gate_up == "concatenated":
            n = w1.shape[1] // 2
            g, u = w1[e, :n].to(dtype), w1[e, n:].to(dtype)
        else:
            raise ValueError(gate_up)
        a = F.silu(xe @ g.T) * (xe @ u.T)
        if probs is not None:
            a = a * probs[b:b + cnt[e]].to(dtype)[:, None]
        pieces.append(a @ w2[e].to(dtype).T)
        rows.append(torch.arange(b, b + cnt[e], device=x.device))
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=dtype, device=x.device)
    if pieces:
        out = out.index_copy(0, torch.cat(rows), torch.cat(pieces))
    # keep every weight in the graph (zero gradients for experts without rows)
    out = out + 0 * (w1.sum() + w2.sum() + (w3.sum() if w3 is not None else 0)).to(dtype)
    return out.to(x.dtype)


def _loop_mm(a, b, counts):
    """out[rows of expert i] = a[rows of i] @ b[i] for contiguous groups (what torch._grouped_mm /
    grouped_gemm.ops.gmm(trans_b=False) compute); rows past sum(counts) are zero (torch._grouped_mm
    leaves them unwritten)."""
    outs, s = [], 0
    for i, c in enumerate(counts):
        outs.append(a[s:s + c] @ b[i])
        s += c
    out = torch.cat(outs) if outs else a.new_zeros((0, b.shape[-1]))
    if s < a.shape[0]:
        out = torch.cat([out, a.new_zeros((a.shape[0] - s, b.shape[-1]))])
    return out


# ---------------------------------------------------------------------------------------------
# torchtitan 0.3.0
# ---------------------------------------------------------------------------------------------
def torchtitan_grouped_experts_forward(w1_EFD, w2_EDF, w3_EFD, x_RD, num_tokens_per_expert_E):
    """torchtitan 0.3.0, torchtitan/models/common/moe.py, GroupedExperts.forward (DTensor branch and
    spmd type-checking elided; GroupedExperts._grouped_mm = torch._grouped_mm(A, B_t, offs) -> loop)."""
    counts = num_tokens_per_expert_E.tolist()
    h_RF = F.silu(_loop_mm(x_RD.bfloat16(), w1_EFD.bfloat16().transpose(-2, -1), counts))
    h_RF = h_RF * _loop_mm(x_RD.bfloat16(), w3_EFD.bfloat16().transpose(-2, -1), counts)
    return _loop_mm(h_RF, w2_EDF.bfloat16().transpose(-2, -1), counts).type_as(x_RD)


class TorchtitanGroupedExpertsTwin(nn.Module):
    """torchtitan 0.3.0 GroupedExperts' parameters (torchtitan/models/common/moe.py, __init__)."""

    def __init__(self, dim, hidden_dim, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.w1_EFD = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3_EFD = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x_RD, num_tokens_per_expert_E):
        return torchtitan_grouped_experts_forward(self.w1_EFD, self.w2_EDF, self.w3_EFD, x_RD, num_tokens_per_expert_E)


# ---------------------------------------------------------------------------------------------
# Megatron-Core 0.16.1
# ---------------------------------------------------------------------------------------------
def grouped_gemm_gmm(a, b, batch_sizes, trans_b=False):
    """grouped_gemm.ops.gmm (fanshiqing/grouped_gemm, the kernel Megatron's GroupedMLP calls):
    out[rows of i] = a[rows of i] @ (b[i].T if trans_b else b[i]); batch_sizes a CPU int64 tensor."""
    return _loop_mm(a, b.transpose(-2, -1) if trans_b else b, [int(c) for c in batch_sizes.tolist()])


def megatron_grouped_mlp_forward(weight1, weight2, num_local_experts, hidden_size, permuted_local_hidden_states,
                                 tokens_per_expert, permuted_probs, moe_apply_probs_on_input=False):
    """megatron-core 0.16.1, megatron/core/transformer/moe/experts.py, GroupedMLP.forward with
    gated_linear_unit=True, activation_func=F.silu (the glu / activation_func_with_probs closures of
    GroupedMLP.__init__), no activation recompute; gg.ops.gmm -> grouped_gemm_gmm."""
    if moe_apply_probs_on_input:
        original_dtype = permuted_local_hidden_states.dtype
        permuted_local_hidden_states = permuted_probs.unsqueeze(-1) * permuted_local_hidden_states
        permuted_local_hidden_states = permuted_local_hidden_states.to(original_dtype)
        permuted_probs = torch.ones_like(permuted_probs)

    def glu(x):
        x = torch.chunk(x, 2, dim=-1)
        return F.silu(x[0]) * x[1]

    def activation_func_with_probs(x, probs):
        dtype = x.dtype
        res = glu(x) * probs
        return res.to(dtype)

    w1 = weight1.view(num_local_experts, hidden_size, -1)
    w2 = weight2.view(num_local_experts, -1, hidden_size)
    tpe = tokens_per_expert.cpu()
    fc1_output = grouped_gemm_gmm(permuted_local_hidden_states, w1, tpe, trans_b=False)
    intermediate_parallel = activation_func_with_probs(fc1_output, permuted_probs.unsqueeze(-1))
    fc2_output = grouped_gemm_gmm(intermediate_parallel, w2, tpe, trans_b=False)
    return fc2_output, None


def megatron_te_grouped_mlp_forward(fc1_weights, fc2_weights, permuted_local_hidden_states, tokens_per_expert,
                                    permuted_probs, moe_apply_probs_on_input=False):
    """megatron-core 0.16.1, megatron/core/transformer/moe/experts.py, TEGroupedMLP.forward with
    gated_linear_unit=True, activation_func=F.silu, no bias, bias_activation_fusion=False,
    use_te_activation_func=False, no fp8 / offloading / recompute (the bias_act_func glu branch);
    linear_fc1 / linear_fc2 are TE GroupedLinear(x, m_splits): y_i = x_i @ weight{i}^T."""
    tokens_per_expert = tokens_per_expert.tolist()
    permuted_probs = permuted_probs.unsqueeze(-1)
    if moe_apply_probs_on_input:
        original_dtype = permuted_local_hidden_states.dtype
        permuted_local_hidden_states = permuted_probs * permuted_local_hidden_states
        permuted_local_hidden_states = permuted_local_hidden_states.to(original_dtype)
        permuted_probs = torch.ones_like(permuted_probs)
    fc1_output = _loop_mm(permuted_local_hidden_states, [w.T for w in fc1_weights], tokens_per_expert)
    x_glu, x_linear = torch.chunk(fc1_output, 2, dim=-1)
    intermediate_parallel = F.silu(x_glu) * (x_linear + 0.0)  # glu_linear_offset = 0
    original_dtype = intermediate_parallel.dtype
    intermediate_parallel = (intermediate_parallel * permuted_probs).to(original_dtype)
    output = _loop_mm(intermediate_parallel, [w.T for w in fc2_weights], tokens_per_expert)
    return output, None


class MegatronGroupedMLPTwin(nn.Module):
    """GroupedMLP's parameters and forward signature (use_cpu_initialization branch of __init__)."""

    def __init__(self, num_local_experts, hidden_size, ffn_hidden_size, config=None):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.config = config
        self.weight1 = nn.Parameter(torch.empty(hidden_size, 2 * ffn_hidden_size * num_local_experts))
        self.weight2 = nn.Parameter(torch.empty(ffn_hidden_size * num_local_experts, hidden_size))

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        return megatron_grouped_mlp_forward(self.weight1, self.weight2, self.num_local_experts, self.hidden_size,
                                            permuted_local_hidden_states, tokens_per_expert, permuted_probs,
                                            getattr(self.config, "moe_apply_probs_on_input", False))


class _GroupedLinearTwin(nn.Module):
    def __init__(self, num_gemms, in_features, out_features):
        super().__init__()
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(torch.empty(out_features, in_features)))


class MegatronTEGroupedMLPTwin(nn.Module):
    """TEGroupedMLP's parameters (linear_fc1.weight{i} [2n, d], linear_fc2.weight{i} [d, n]) and forward."""

    def __init__(self, num_local_experts, hidden_size, ffn_hidden_size, config=None):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.config = config
        self.linear_fc1 = _GroupedLinearTwin(num_local_experts, hidden_size, 2 * ffn_hidden_size)
        self.linear_fc2 = _GroupedLinearTwin(num_local_experts, ffn_hidden_size, hidden_size)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        E = self.num_local_experts
        return megatron_te_grouped_mlp_forward([getattr(self.linear_fc1, f"weight{i}") for i in range(E)],
                                               [getattr(self.linear_fc2, f"weight{i}") for i in range(E)],
                                               permuted_local_hidden_states, tokens_per_expert, permuted_probs,
                                               getattr(self.config, "moe_apply_probs_on_input", False))


# ---------------------------------------------------------------------------------------------
# transformers 5.24.0
# ---------------------------------------------------------------------------------------------
def transformers_eager_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers 5.24.0, transformers/models/qwen3_moe/modeling_qwen3_moe.py, Qwen3MoeExperts.forward
    (the same body as MixtralExperts / DeepseekV3Experts / OlmoeExperts and the example in
    transformers/integrations/moe.py)."""
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()

    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))

    return final_hidden_states


class TransformersExpertsTwin(nn.Module):
    """Qwen3MoeExperts' parameters plus the attributes @use_experts_implementation() sets (defaults:
    concatenated, not transposed, no bias, gated, no post-expert norm)."""

    def __init__(self, num_experts, hidden_dim, intermediate_dim):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim, hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, intermediate_dim))
        self.act_fn = nn.SiLU()
        self.has_gate, self.has_bias, self.has_post_expert_norm = True, False, False
        self.is_transposed, self.is_concatenated, self._is_expert_parallel = False, True, False

    forward = transformers_eager_experts_forward
