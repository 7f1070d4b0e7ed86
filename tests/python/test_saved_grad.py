"""CPU tests: the autograd of the smoe forward ops passes no materialized gradient for the saved state.

Each forward op returns (out, saved); saved is the uint8 state the backward reads. By default the autograd
engine hands a backward a zero tensor for every output without a gradient, here one of the saved state's
size (4TKn bytes), allocated and filled on every backward (0.16-0.52 ms a step on the H100,
bench/results/h100/sonic_profile.md). python/smoe_torch/_ops.py turns that off in every setup_context.
The first test reads _ops.py (no torch, no extension: it runs in CI); the second checks the torch
behaviour the fix relies on, on a CPU op of the same shape (skipped without torch). The GPU test
test_torch_moe.py::test_backward_allocates_no_gradient_for_the_saved_state measures it on the real ops.
"""
import ast
import os

import pytest

OPS = os.path.join(os.path.dirname(__file__), "..", "..", "python", "smoe_torch", "_ops.py")


def _functions_and_registrations():
    tree = ast.parse(open(OPS).read(), OPS)
    funcs = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    regs = []
    for call in ast.walk(tree):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "register_autograd"):
            kw = {k.arg: k.value for k in call.keywords}
            regs.append((ast.literal_eval(call.args[0]), call.args[1].id, kw["setup_context"].id))
    return funcs, regs


def _calls(fn, name):
    return [c for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == name]


def test_every_forward_op_takes_no_gradient_for_its_saved_state():
    funcs, regs = _functions_and_registrations()
    ops = sorted(op for op, _, _ in regs)
    assert ops == ["smoe::ep_forward", "smoe::moe_forward", "smoe::moe_forward_routed", "smoe::moe_forward_tr"], ops
    for op, backward, setup in regs:
        assert _calls(funcs[setup], "_saved_takes_no_grad"), f"{op}: {setup} must call _saved_takes_no_grad"
        # with grads not materialized, the output's gradient may be None: each backward goes through _dout
        assert _calls(funcs[backward], "_dout"), f"{op}: {backward} must pass the gradient through _dout"
    helper = funcs["_saved_takes_no_grad"]
    called = {c.func.attr for c in ast.walk(helper) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)}
    assert {"mark_non_differentiable", "set_materialize_grads"} <= called, called
    flag = [c for c in ast.walk(helper) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
            and c.func.attr == "set_materialize_grads"][0]
    assert ast.literal_eval(flag.args[0]) is False


def test_torch_hands_a_zero_filled_saved_gradient_unless_told_not_to():
    torch = pytest.importorskip("torch")
    lib = torch.library.Library("smoe_saved_grad_test", "DEF")
    lib.define("fwd(Tensor x) -> (Tensor, Tensor)")
    lib.impl("fwd", lambda x: (x * 2, torch.ones(1 << 16, dtype=torch.uint8)), "CPU")
    seen, mode = {}, {}

    def setup(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(mode["materialize"])

    def backward(ctx, dout, dsaved):
        seen["dsaved"] = dsaved
        return 2 * dout

    torch.library.register_autograd("smoe_saved_grad_test::fwd", backward, setup_context=setup, lib=lib)
    for materialize in (True, False):
        mode["materialize"] = materialize
        x = torch.randn(5, requires_grad=True)
        out, _ = torch.ops.smoe_saved_grad_test.fwd(x)
        out.sum().backward()
        assert torch.equal(x.grad, torch.full((5,), 2.0))
        if materialize:  # the default: a zero tensor as large as the saved state
            assert seen["dsaved"].numel() == 1 << 16 and int(seen["dsaved"].sum()) == 0
        else:
            assert seen["dsaved"] is None
