"""The training engine's linear layers through OpenBLAS (rlflow.engine.cpu_gemm, kernels/gemm.cpp):
products equal torch's to float rounding in every operand layout, the same bits at any thread
count, both gradients of a linear layer, which calls take it, how ``cpu_gemm`` resolves, and the
engine's and the config's switch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rlflow.data.tiny_models import build_tiny_model
from rlflow.engine import cpu_gemm, parallelize
from rlflow.engine.cpu_gemm import LinearFunction, mm, resolve_cpu_gemm, route_linears
from rlflow.engine.train_engine import EngineConfig, TrainEngine

pytestmark = pytest.mark.skipif(cpu_gemm.openblas_blocker() is not None, reason=str(cpu_gemm.openblas_blocker()))


def _operand(rows: int, cols: int, layout: str, seed: int) -> torch.Tensor:
    """A (rows, cols) matrix laid out row-major, as a transposed view, or as a strided slice."""
    g = torch.Generator().manual_seed(seed)
    if layout == "rows":
        return torch.randn(rows, cols, generator=g)
    if layout == "transposed":
        return torch.randn(cols, rows, generator=g).t()
    return torch.randn(rows, 2 * cols + 3, generator=g)[:, 1 : 2 * cols + 1 : 2]  # a copy is taken


@pytest.mark.parametrize("layout_a", ["rows", "transposed", "strided"])
@pytest.mark.parametrize("layout_b", ["rows", "transposed"])
@pytest.mark.parametrize("m, k, n", [(150, 37, 61), (61, 37, 150), (1, 5, 1), (97, 1, 49)])
def test_products_equal_torch_in_every_layout(layout_a, layout_b, m, k, n):
    # m > n splits C's rows over the threads, m < n its columns; neither a multiple of the shares' 48
    a, b = _operand(m, k, layout_a, 0), _operand(k, n, layout_b, 1)
    with_threads = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        with_threads.append(mm(a, b))
    torch.set_num_threads(1)
    torch.testing.assert_close(with_threads[0], a @ b, atol=1e-5, rtol=1e-5)
    for other in with_threads[1:]:
        assert torch.equal(other, with_threads[0])  # K is never split: one dot product per element


def test_empty_products_and_mismatched_shapes():
    assert mm(torch.randn(0, 4), torch.randn(4, 3)).shape == (0, 3)
    assert torch.equal(mm(torch.randn(2, 0), torch.randn(0, 3)), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"shapes \(2, 4\) and \(3, 3\) do not multiply"):
        mm(torch.randn(2, 4), torch.randn(3, 3))


def _passes(fn, x, weight, bias, grad):
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in (x, weight, bias)]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), *(t.grad if t is not None else None for t in leaves)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("frozen", ["nothing", "weight", "input"])
def test_linear_function_equals_f_linear_in_both_passes(bias, frozen):
    torch.set_num_threads(2)
    x = torch.randn(3, 70, 96).requires_grad_(frozen != "input")
    weight = torch.randn(130, 96).requires_grad_(frozen != "weight")
    b = torch.randn(130, requires_grad=True) if bias else None
    grad = torch.randn(3, 70, 130)
    got = _passes(LinearFunction.apply, x, weight, b, grad)
    want = _passes(F.linear, x, weight, b, grad)
    torch.set_num_threads(1)
    for name, g, w in zip(("output", "input's", "weight's", "bias's"), got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-5, msg=name)


def test_routed_layers_fall_back_where_openblas_does_not_take_the_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8, bias=False))
    assert route_linears(model) == 2
    assert "forward" in vars(model[0]) and "forward" in vars(model[2])
    x = torch.randn(5, 16)
    torch.testing.assert_close(model(x), model[2](torch.relu(F.linear(x, model[0].weight, model[0].bias))))
    bf16 = model.to(torch.bfloat16)(x.bfloat16())  # bf16: F.linear
    assert bf16.dtype == torch.bfloat16 and bf16.grad_fn.name() != "LinearFunctionBackward"
    model.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: F.linear, which autocast casts
        assert model(x).dtype == torch.bfloat16
    assert model(x).grad_fn.name() == "LinearFunctionBackward"


def test_cpu_gemm_resolves(monkeypatch):
    assert resolve_cpu_gemm("torch") == "torch"
    assert resolve_cpu_gemm("openblas") == "openblas"
    with pytest.raises(ValueError, match="cpu_gemm='mkl': expected one of auto, openblas, torch"):
        resolve_cpu_gemm("mkl")
    monkeypatch.setattr(cpu_gemm.platform, "machine", lambda: "x86_64")
    for vendor, want in (("AuthenticAMD", "openblas"), ("HygonGenuine", "openblas"), ("GenuineIntel", "torch")):
        monkeypatch.setattr(parallelize, "cpu_vendor", lambda vendor=vendor: vendor)
        assert resolve_cpu_gemm("auto") == want, vendor
    monkeypatch.setattr(parallelize, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(cpu_gemm.platform, "machine", lambda: "aarch64")
    assert resolve_cpu_gemm("auto") == "torch"
    monkeypatch.setattr(cpu_gemm, "_openblas", lambda: "the scipy-openblas32 wheel is not installed")
    with pytest.raises(ValueError, match="cpu_gemm='openblas': the scipy-openblas32 wheel is not installed"):
        resolve_cpu_gemm("openblas")
    monkeypatch.setattr(cpu_gemm.platform, "machine", lambda: "x86_64")
    assert resolve_cpu_gemm("auto") == "torch"


def test_the_engine_switch_trains_alike(single_mesh):
    results = {}
    for choice in ("openblas", "torch"):
        model = build_tiny_model(vocab_size=32, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=4)
        engine = TrainEngine(model, single_mesh, EngineConfig(cpu_gemm=choice, device="cpu", optim=None))
        routed = [m for m in engine.stage.modules() if isinstance(m, nn.Linear) and "forward" in vars(m)]
        assert len(routed) == (15 if choice == "openblas" else 0)  # 7 a layer and the head
        ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
        logits = engine.stage(ids, torch.ones_like(ids), position_ids=torch.arange(9).expand(2, 9))
        logits.float().pow(2).mean().backward()
        results[choice] = (logits.detach(), {n: p.grad.clone() for n, p in engine.stage.named_parameters()})
    torch.testing.assert_close(results["openblas"][0], results["torch"][0], atol=1e-5, rtol=1e-5)
    for name, grad in results["torch"][1].items():
        torch.testing.assert_close(results["openblas"][1][name], grad, atol=1e-6, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="cpu_gemm='blas'"):
        EngineConfig(cpu_gemm="blas")


def test_the_driver_passes_cpu_gemm_on_and_refuses_an_openblas_that_cannot_load(monkeypatch, tmp_path):
    from rlflow.dataflow import algorithm_mfcs
    from rlflow.strategy import ParallelStrategy
    from rlflow.trainer import ConfigError, load_config
    from rlflow.trainer.build import model_setups
    from rlflow.trainer.runner import CallPlacement

    calls = {
        m.name: CallPlacement(m, (0,), ParallelStrategy())
        for m in algorithm_mfcs("grpo", rule_based_reward=True, use_ref=False)
    }

    def setups(*overrides: str, use_gpu: bool = False):
        return model_setups(load_config(None, list(overrides)), {"actor": str(tmp_path)}, calls, "arithmetic", use_gpu)

    assert setups()["actor"].cpu_gemm == "auto"
    assert setups("models.actor.cpu_gemm=torch")["actor"].cpu_gemm == "torch"
    with pytest.raises(ConfigError, match="models.actor.cpu_gemm"):
        load_config(None, ["models.actor.cpu_gemm=mkl"])
    monkeypatch.setattr(cpu_gemm, "_openblas", lambda: "the scipy-openblas32 wheel is not installed")
    with pytest.raises(
        ValueError, match="models.actor.cpu_gemm='openblas': the scipy-openblas32 wheel is not installed"
    ):
        setups("models.actor.cpu_gemm=openblas")
    assert setups("models.actor.cpu_gemm=openblas", use_gpu=True)["actor"].cpu_gemm == "openblas"  # GPU workers: unused
