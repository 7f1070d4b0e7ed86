# Reproduces the crash of torch.ops.smoe.moe_forward on a bad top_k (for cuda-gdb).
import torch
import smoe_torch  # noqa: F401
E, n, d, T = 8, 64, 128, 64
x = torch.randn(T, d, device="cuda").bfloat16()
wr = torch.randn(E, d, device="cuda").bfloat16()
w1 = torch.randn(E, 2 * n, d, device="cuda").bfloat16()
w2 = torch.randn(E, d, n, device="cuda").bfloat16()
try:
    torch.ops.smoe.moe_forward(x, wr, w1, w2, 17)
except RuntimeError as e:
    print("raised:", str(e)[:200])
