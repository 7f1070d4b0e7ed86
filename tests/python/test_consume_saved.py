"""CPU tests: when the torch backward may spend the saved state (consume_saved: dH written over H).

python/smoe_torch/_ops.py's _consume_saved(saved) decides, per backward call, whether the smoe backward
op may write dH over the saved H (MoEBackwardArgs::consume_saved, H's 4TKn bytes less workspace at the
backward's peak). It must say yes only where nothing can read the saved state again: an eager backward
run by the autograd engine without keep_graph. Here the function is read from _ops.py (the extension is
not needed) and driven from a CPU autograd.Function with a saved tensor of the same kind, through
backward(), retain_graph, create_graph, autograd.grad, batched gradients (vmap: one saved state for every
slice), a direct call, activation checkpointing (whose recompute's saved state is freed the same way), and
torch.compile (aot_eager: the backward is traced, and a traced graph must never carry the flag). The GPU test test_torch_moe.py::
test_backward_consumes_the_saved_state_only_when_autograd_frees_it runs the real ops.
"""
import ast
import os

import pytest

torch = pytest.importorskip("torch")

OPS = os.path.join(os.path.dirname(__file__), "..", "..", "python", "smoe_torch", "_ops.py")


def _load_consume_saved(env_off=False):
    tree = ast.parse(open(OPS).read(), OPS)
    fn = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "_consume_saved")
    ns = {"torch": torch, "os": os, "_CONSUME_OFF": env_off}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), OPS, "exec"), ns)
    return ns["_consume_saved"]


def test_every_backward_op_call_passes_the_decision():
    tree = ast.parse(open(OPS).read(), OPS)
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
             and isinstance(c.func.value, ast.Name) and c.func.value.id == "ops"
             and c.func.attr in ("moe_backward", "moe_backward_tr", "moe_backward_routed")]
    assert sorted(c.func.attr for c in calls) == ["moe_backward", "moe_backward_routed", "moe_backward_tr"]
    for c in calls:
        last = c.args[-1]
        assert isinstance(last, ast.Call) and getattr(last.func, "id", None) == "_consume_saved", \
            f"{c.func.attr}: its last argument must be _consume_saved(saved, dout)"
        assert [getattr(a, "id", None) for a in last.args] == ["saved", "dout"], f"{c.func.attr}: pass saved and dout"


# A CPU op registered the way _ops.py registers the smoe forward ops (torch.library, a fake, autograd
# by register_autograd): out = 2 x, and a uint8 state saved for backward, whose backward records the
# decision. torch.compile treats it as _ops.py's ops: opaque to dynamo, its backward traced by AOTAutograd.
_SEEN = []
_DECIDE = {}


@torch.library.custom_op("smoe_consume_test::fwd", mutates_args=())
def _fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, torch.ones(64, dtype=torch.uint8)


@_fwd.register_fake
def _fwd_fake(x):
    return torch.empty_like(x), x.new_empty((64,), dtype=torch.uint8)


def _setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(output[1])


def _bwd(ctx, dout, _dstate):
    (state,) = ctx.saved_tensors
    _SEEN.append(_DECIDE["f"](state, dout))
    return dout * 2


torch.library.register_autograd("smoe_consume_test::fwd", _bwd, setup_context=_setup)


class _Layer:
    @staticmethod
    def apply(x):
        return _fwd(x)

    @staticmethod
    def decide(state):
        return _DECIDE["f"](state)


def _use(env_off=False):
    _DECIDE["f"] = _load_consume_saved(env_off)


def _run(fn):
    _SEEN.clear()
    fn()
    return list(_SEEN)


def test_only_an_eager_backward_that_frees_the_state_consumes():
    _use()
    x = torch.randn(4, requires_grad=True)
    assert _run(lambda: _Layer.apply(x)[0].sum().backward()) == [True]
    assert _run(lambda: torch.autograd.grad(_Layer.apply(x)[0].sum(), x)) == [True]
    # retain_graph: a second backward reads the state again
    def twice():
        y = _Layer.apply(x)[0].sum()
        y.backward(retain_graph=True)
        y.backward()
    assert _run(twice) == [False, True]
    assert _run(lambda: torch.autograd.grad(_Layer.apply(x)[0].sum(), x, create_graph=True)) == [False]
    # activation checkpointing: the recompute's state is the backward's own
    from torch.utils.checkpoint import checkpoint
    assert _run(lambda: checkpoint(lambda t: _Layer.apply(t)[0], x, use_reentrant=False).sum().backward()) == [True]
    # not run by the autograd engine: no graph task
    state = torch.ones(8, dtype=torch.uint8)
    assert _Layer.decide(state) is False


def test_batched_gradients_never_consume():
    """autograd.grad(is_grads_batched=True) runs the backward under vmap: once per slice on one saved
    state, so the first slice must not spend it."""
    _use()
    x = torch.randn(4, requires_grad=True)
    y = _Layer.apply(x)[0]
    seen = _run(lambda: torch.autograd.grad(y, x, grad_outputs=torch.eye(4), is_grads_batched=True))
    assert seen and not any(seen), seen


def test_a_traced_backward_never_consumes():
    _use()
    x = torch.randn(4, requires_grad=True)
    f = torch.compile(lambda t: _Layer.apply(t)[0].sum(), backend="aot_eager", fullgraph=True)
    seen = _run(lambda: f(x).backward())
    assert seen and not any(seen), seen  # traced once with fake tensors: the flag is never baked in
    torch._dynamo.reset()


def test_the_switch_turns_it_off():
    _use(env_off=True)
    x = torch.randn(4, requires_grad=True)
    assert _run(lambda: _Layer.apply(x)[0].sum().backward()) == [False]
