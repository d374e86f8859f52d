"""The fused CPU kernels (rlflow.engine.fused_ops, kernels/fused.cpp) against HF's ops: RMSNorm,
SwiGLU and RoPE, both passes at float rounding, the same bits at any thread count, which modules
take them and when HF's own ops run instead; and the training engine's switch."""

from __future__ import annotations

import sys

import pytest
import torch
from test_fast_decode import build_model
from torch import nn

from rlflow.data.tiny_models import build_tiny_model
from rlflow.engine import fused_ops
from rlflow.engine.fused_ops import RMSNormFunction, RoPEFunction, SwiGLUFunction, fuse_cpu_ops
from rlflow.engine.train_engine import EngineConfig, TrainEngine

torch.set_num_threads(1)


def _norm(hidden: int = 48, seed: int = 0):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(seed)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    return norm


def _passes(norm: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_(True)
    norm.zero_grad(set_to_none=True)
    y = norm(x)
    y.backward(grad)
    return y.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize("shape", [(3, 7, 48), (200, 48), (1, 48)])
def test_both_passes_equal_hfs(shape):
    plain, fused = _norm(), _norm()
    assert fuse_cpu_ops(fused) == 1
    x, grad = torch.randn(shape) * 3, torch.randn(shape)
    for want, got in zip(_passes(plain, x, grad), _passes(fused, x, grad)):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_the_fused_passes_run_and_would_be_caught_if_wrong(monkeypatch):
    """The module's forward is the fused one (a wrong kernel would show) and its gradient reaches
    the weight through the Function, not through HF's ops."""
    norm = _norm()
    fuse_cpu_ops(norm)
    calls = []
    monkeypatch.setattr(RMSNormFunction, "backward", staticmethod(lambda ctx, g: calls.append(1) or (g, None, None)))
    x = torch.randn(4, 48, requires_grad=True)
    norm(x).sum().backward()
    assert calls == [1] and norm.weight.grad is None


def test_the_weight_gradient_has_the_same_bits_at_any_thread_count():
    norm = _norm(hidden=64)
    fuse_cpu_ops(norm)
    x, grad = torch.randn(300, 64), torch.randn(300, 64)  # several blocks of rows
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        results.append(_passes(norm, x, grad))
    torch.set_num_threads(1)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("case", ["llama", "qwen3", "mistral"])
def test_a_whole_models_loss_and_gradients_equal_hfs(case):
    # The norms and MLPs are compared here; RoPE, replaced for the whole process once any model is
    # fused, runs fused in both models (test_rope_equals_hfs_in_both_passes compares it with HF's).
    plain, fused = build_model(case, seed=3).train(), build_model(case, seed=3).train()
    layers = plain.config.num_hidden_layers
    # two norms a layer and the final one; Qwen3's per-head q/k norms are the same module class
    per_head = 2 * layers if case == "qwen3" else 0  # Qwen3's q/k norms: the same math per head
    # the norms, the MLPs and the attention modules (marked for the packed kernel, unused here: no packing)
    assert fuse_cpu_ops(fused) == 2 * layers + 1 + per_head + 2 * layers
    assert getattr(sys.modules[type(fused).__module__].apply_rotary_pos_emb, "rlflow_fused", None) is not None
    ids = torch.randint(0, plain.config.vocab_size, (3, 11))
    losses = []
    for model in (plain, fused):
        logits = model(input_ids=ids).logits
        loss = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=0)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_other_inputs_run_the_modules_own_forward():
    plain, fused = _norm(), _norm()
    fuse_cpu_ops(fused)
    x = torch.randn(5, 48)
    assert torch.equal(fused(x.bfloat16()), plain(x.bfloat16()))  # bf16: HF's own ops, bit for bit
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(fused(x), plain(x))

    class Wrapped(torch.Tensor):  # a subclass (a DTensor, a collective's pending result) is not read raw
        pass

    assert torch.equal(fused(x.as_subclass(Wrapped)), plain(x.as_subclass(Wrapped)))
    fused.weight.data = fused.weight.data.double()  # a weight the kernels do not take
    assert fused(x.double()).dtype == torch.float64


def test_only_llamas_norm_math_is_fused():
    class OnePlusNorm(nn.Module):  # Gemma's kind: weight applied as (1 + weight)
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(8))

        def forward(self, x):
            return x * (1 + self.weight)

    model = nn.Sequential(_norm(8), OnePlusNorm(), nn.Linear(8, 8))
    assert fuse_cpu_ops(model) == 1
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1])


def test_without_the_build_nothing_is_fused(monkeypatch):
    monkeypatch.setattr(fused_ops, "_C_fused", None)
    assert fused_ops.fused_cpu_ops_blocker() == "rlflow._C_fused is not built (pip install -e .)"
    assert fuse_cpu_ops(_norm()) == 0


def test_the_engine_switch_and_its_forward(single_mesh):
    outputs = {}
    for fused in (True, False):
        model = build_tiny_model(vocab_size=32, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=4)
        engine = TrainEngine(model, single_mesh, EngineConfig(fused_cpu_ops=fused, device="cpu", optim=None))
        patched = [m for m in engine.stage.modules() if "forward" in vars(m)]
        assert len(patched) == (7 if fused else 0)  # two norms and the MLP a layer, the final norm
        ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        outputs[fused] = engine.forward(batch)
    for key, value in outputs[False].items():
        torch.testing.assert_close(outputs[True][key], value, atol=1e-5, rtol=0, msg=key)


def _grads(fn, *inputs, grad):
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def test_swiglu_equals_silu_times_up_in_both_passes():
    gate, up = torch.randn(7, 130) * 4, torch.randn(7, 130)  # 910 floats: vector body and scalar tail
    gate[0, :4] = torch.tensor([-100.0, -88.0, 88.0, 100.0])  # the exponential's clamps
    grad = torch.randn(7, 130)
    want = _grads(lambda g, u: torch.nn.functional.silu(g) * u, gate, up, grad=grad)
    got = _grads(SwiGLUFunction.apply, gate, up, grad=grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("table_batch", [1, 3])
def test_rope_equals_hfs_in_both_passes(table_batch):
    from transformers.models.llama import modeling_llama

    original = getattr(modeling_llama.apply_rotary_pos_emb, "rlflow_fused", modeling_llama.apply_rotary_pos_emb)
    x = torch.randn(3, 5, 4, 16).transpose(1, 2)  # (B, H, T, D) as HF's attention views its projection
    cos, sin = torch.randn(table_batch, 5, 16), torch.randn(table_batch, 5, 16)
    grad = torch.randn(3, 4, 5, 16)
    want = _grads(lambda q: original(q, q, cos, sin)[0], x, grad=grad)
    got = _grads(lambda q: RoPEFunction.apply(q, cos, sin), x, grad=grad)
    assert got[0].stride() == want[0].stride()  # laid out as HF lays it out
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_the_rope_dispatcher_runs_hfs_ops_for_what_it_does_not_take():
    from transformers.models.llama import modeling_llama

    fuse_cpu_ops(build_model("llama"))
    fused = modeling_llama.apply_rotary_pos_emb
    original = fused.rlflow_fused
    q, cos, sin = torch.randn(2, 4, 5, 16), torch.randn(1, 5, 16), torch.randn(1, 5, 16)
    for args in ((q.bfloat16(), q.bfloat16(), cos.bfloat16(), sin.bfloat16()), (q, q, cos[..., :8], sin[..., :8])):
        try:
            want = original(*args)
        except RuntimeError:  # shapes HF's own ops refuse are refused the same way
            with pytest.raises(RuntimeError):
                fused(*args)
            continue
        assert all(torch.equal(a, b) for a, b in zip(fused(*args), want))
    seq_first = q.transpose(1, 2)  # (B, T, H, D): HF's unsqueeze_dim=2 layout
    assert all(
        torch.equal(a, b)
        for a, b in zip(fused(seq_first, seq_first, cos, sin, 2), original(seq_first, seq_first, cos, sin, 2))
    )


def test_swiglu_mlps_only():
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = build_model("llama").config
    silu, gelu = LlamaMLP(config), LlamaMLP(config)
    gelu.act_fn = torch.nn.GELU()
    assert fuse_cpu_ops(nn.Sequential(silu, gelu)) == 1 and "forward" in vars(silu) and "forward" not in vars(gelu)
