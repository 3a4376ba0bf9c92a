"""fp8 GEMMs on the CPU: the fast path (``torch._scaled_mm``, which this CPU torch runs too) held to cuBLASLt's rules
and compared with its emulation, and the emulation compared with a reference written here.

``model.linear_backend=fp8_all`` runs the forward and both backward GEMMs in fp8 (the output gradient in e5m2):
- a checker wraps ``torch._scaled_mm`` with the rules the GPU's fp8 GEMM enforces (mat1 row-major, mat2
  column-major, every dim a multiple of 16, never two e5m2 operands, one fp32 scale each), so a layout or padding
  the GPU would refuse fails here, on every session, not only on a lent GPU;
- the fast path equals the emulation (forward, dX, dW, the bias gradient; rows padded or not; bf16 autocast);
- the emulation equals what the recipe says, computed here from torch's own float8 casts and fp64 GEMMs;
- compiled, the ``_scaled_mm`` calls of the traced forward and backward graphs keep those layouts;
- a model trained with it: the fast path forced on the CPU equals the emulation step for step, and its loss follows
  the fp32 model's; with tensor parallelism (T = 2) each rank's shards take the fast path and equal the emulation.
(``fp8``, the forward GEMM alone, goes through the same checker; its straight-through backward is tested in
test_model.py; graph breaks under ``train.compile`` in test_hot_path.py.)"""

from __future__ import annotations

import pytest
import torch

import dilocox.model.fp8 as fp8
from dilocox.config import ModelConfig
from dilocox.model.transformer import build_model
from tests.spawn import run_ranks

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture
def cublaslt(monkeypatch):
    """``torch._scaled_mm`` under the GPU's rules; yields the list of calls ``(a dtype, b dtype, a shape, b shape)``."""
    import torch._dynamo  # noqa: F401  (first: dynamo's tables of torch's ops, made at its import, keep the real op)

    calls, real = [], torch._scaled_mm

    def checked(a, b, *, scale_a, scale_b, out_dtype, **kw):
        assert a.dtype in (E4, E5) and b.dtype in (E4, E5), (a.dtype, b.dtype)
        assert not (a.dtype == b.dtype == E5), "two e5m2 operands: not supported by the fp8 tensor cores"
        assert a.is_contiguous(), f"mat1 must be row-major: {a.shape} strides {a.stride()}"
        assert b.t().is_contiguous(), f"mat2 must be column-major: {b.shape} strides {b.stride()}"
        assert all(d % 16 == 0 for d in (*a.shape, *b.shape)), (a.shape, b.shape)
        assert out_dtype in (torch.bfloat16, torch.float16, torch.float32), out_dtype
        for s in (scale_a, scale_b):
            assert s.dtype == torch.float32 and s.numel() == 1 and s.device == a.device
        calls.append((a.dtype, b.dtype, tuple(a.shape), tuple(b.shape)))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", checked)
    return calls


def _dq(t: torch.Tensor, dtype) -> torch.Tensor:
    """The recipe, written out: scale so amax lands on the format's largest value (fp32), cast, scale back (fp64)."""
    fmax = torch.finfo(dtype).max
    scale = fmax / t.detach().abs().max().float().clamp(min=1e-12)
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype).double() / scale.double()


def _run(fn, x, w, b, dy):
    xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
    y = fn(xx, ww, bb)
    y.backward(dy.to(y.dtype))
    return y.detach(), xx.grad, ww.grad, bb.grad


def _case(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 256, generator=g) * 3
    w = torch.randn(384, 256, generator=g) * 0.02
    b = torch.randn(384, generator=g)
    dy = torch.randn(m, 384, generator=g) * 1e-3
    return x, w, b, dy


@pytest.mark.parametrize("m", [64, 50])  # 50 rows: padded to 64 for _scaled_mm
def test_all_three_gemms_fast_path_equals_emulation_under_cublaslt_rules(m, cublaslt):
    x, w, b, dy = _case(m)
    fast = _run(lambda *a: fp8.fp8_linear_all(*a, emulate=False), x, w, b, dy)
    assert [(c[0], c[1]) for c in cublaslt] == [(E4, E4), (E5, E4), (E5, E4)]  # forward, dX, dW
    assert cublaslt[2][2] == (384, 64)  # dY^T with its padded rows: the zero rows add nothing to dW
    emu = _run(lambda *a: fp8.fp8_linear_all(*a, emulate=True), x, w, b, dy)
    for name, f, e in zip(("y", "dX", "dW", "db"), fast, emu):
        assert f.shape == e.shape and f.dtype == e.dtype == torch.float32, name
        torch.testing.assert_close(f, e, rtol=1e-5, atol=1e-6 * e.abs().max().item(), msg=name)


def test_the_emulation_is_the_recipe():
    x, w, b, dy = _case(40, seed=1)
    y, dx, dw, db = _run(lambda *a: fp8.fp8_linear_all(*a, emulate=True), x, w, b, dy)
    xq, wq, gq = _dq(x, E4), _dq(w, E4), _dq(dy, E5)
    ref = {"y": xq @ wq.t() + b.double(), "dX": gq @ wq, "dW": gq.t() @ xq, "db": dy.double().sum(0)}
    for name, got in zip(ref, (y, dx, dw, db)):
        torch.testing.assert_close(got.double(), ref[name], rtol=1e-5, atol=1e-6 * ref[name].abs().max().item())
    exact = {"y": x @ w.t() + b, "dX": dy @ w, "dW": dy.t() @ x}
    for name, got in zip(exact, (y, dx, dw)):  # it did quantize: e4m3 has 3 mantissa bits, e5m2 2
        err = ((got - exact[name]).norm() / exact[name].norm()).item()
        assert 1e-3 < err < 0.1, (name, err)


def test_bf16_autocast_keeps_the_dtypes_and_the_forward_gemm_alone_obeys_the_rules(cublaslt):
    x, w, b, dy = _case(50, seed=2)
    for fn in (fp8.fp8_linear_all, fp8.fp8_linear):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fast = _run(lambda *a, f=fn: f(*a, emulate=False), x, w, b, dy)
            emu = _run(lambda *a, f=fn: f(*a, emulate=True), x, w, b, dy)
        assert fast[0].dtype == torch.bfloat16 and fast[1].dtype == fast[2].dtype == torch.float32
        for name, f, e in zip(("y", "dX", "dW"), fast, emu):
            torch.testing.assert_close(f.float(), e.float(), rtol=1e-2, atol=1e-2 * e.abs().max().item(), msg=name)
    assert len(cublaslt) == 3 + 1  # fp8_all: three GEMMs; fp8: the forward one


def _as_on_hopper(device, shape=None):
    """``fp8.emulation_reason`` as on a Hopper GPU, for this CPU: the fast path for every weight whose dims are
    multiples of 16 (this CPU torch runs ``torch._scaled_mm`` too)."""
    return "a shape" if shape is not None and (shape[0] % 16 or shape[1] % 16) else None


def _train(backend: str, steps: int, monkeypatch=None, fast=False):
    if fast:  # the fast path on this CPU: as on a Hopper GPU, _scaled_mm runs every fp8 GEMM
        monkeypatch.setattr(fp8, "emulation_reason", _as_on_hopper)
    mcfg = ModelConfig(n_layers=2, n_heads=4, d_model=64, vocab_size=96, max_seq_len=32, linear_backend=backend)
    model = build_model(mcfg, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(4))
    losses = []
    for _ in range(steps):
        loss = model.loss(model(x)[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if fast:
        monkeypatch.undo()
    return losses, model


def test_a_model_on_the_fast_path_trains_as_its_emulation_and_follows_fp32(monkeypatch, cublaslt):
    fast, _ = _train("fp8_all", 6, monkeypatch, fast=True)
    assert len(cublaslt) == 6 * 2 * 6 * 3  # steps x blocks x linears (q, k, v, o, fc, proj; not the head) x GEMMs
    emu, _ = _train("fp8_all", 6)
    assert fast == pytest.approx(emu, rel=1e-5)
    ref, _ = _train("torch", 40)
    got, _ = _train("fp8_all", 40)
    assert got[-1] < 0.5 * got[0]  # it learns the batch
    assert abs(got[-1] - ref[-1]) < 0.05 * ref[-1], (got[-1], ref[-1])  # measured: 0.1063 against 0.1047
    assert got != ref  # and it did run in fp8


def test_the_reference_bench_names_the_fp8_rows_and_sizes_the_1b_case(tmp_path):
    from dilocox.bench import reference as R
    from dilocox.model.transformer import model_flops_per_token

    for mode, backend in (("compiled", "torch"), ("eager, fp8", "fp8"), ("compiled, fp8_all", "fp8_all")):
        assert R.dilocox_config("tiny", "cpu", mode, 2, str(tmp_path)).model.linear_backend == backend, mode
    cfg = R.dilocox_config("1b", "cuda", "compiled, fp8_all", 2, str(tmp_path))
    blocks = (model_flops_per_token(cfg.model, 0) // 6) - cfg.model.d_model * cfg.model.vocab_size  # less the head
    assert blocks > 1e9 and ("1b", "compiled") in R.GPU_TABLE and ("1b", "compiled, fp8_all") in R.GPU_TABLE


@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_the_fast_path_keeps_the_layouts_the_gpu_needs(autocast):
    """The strides of every ``_scaled_mm`` in the graphs ``torch.compile`` traces (forward and backward, via
    AOTAutograd), where the eager checker does not reach."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def capture(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.target is torch.ops.aten._scaled_mm.default:
                seen.append((n.args[0].meta["val"], n.args[1].meta["val"]))
        return make_boxed_func(gm)

    torch._dynamo.reset()
    f = torch.compile(lambda *a: fp8.fp8_linear_all(*a, emulate=False), backend=aot_autograd(fw_compiler=capture))
    x, w, b, dy = _case(50, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        fast = _run(f, x, w, b, dy)
        emu = _run(lambda *a: fp8.fp8_linear_all(*a, emulate=True), x, w, b, dy)
    torch._dynamo.reset()
    assert [(m1.dtype, m2.dtype) for m1, m2 in seen] == [(E4, E4), (E5, E4), (E5, E4)]
    for m1, m2 in seen:  # mat1 row-major, mat2 column-major
        assert m1.stride()[1] == 1 and m2.stride()[0] == 1, (m1.shape, m1.stride(), m2.shape, m2.stride())
        assert all(d % 16 == 0 for d in (*m1.shape, *m2.shape)), (m1.shape, m2.shape)
    for name, got, ref in zip(("y", "dX", "dW"), fast, emu):
        tol = 1e-2 if autocast else 1e-5
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item(), msg=name)


def _tp_losses(rank, world, tmp, steps):
    import torch._dynamo  # noqa: F401  (before torch._scaled_mm is patched: see the cublaslt fixture)
    from test_train import QWEN_ARGS

    from dilocox.train import Trainer
    from tests.small_run import small_cfg

    real, real_mm, out, calls = fp8.emulation_reason, torch._scaled_mm, {}, []
    for name, backend in (("emulated", "fp8_all"), ("fast", "fp8_all"), ("torch", "torch")):
        if name == "fast":  # each rank's shards through torch._scaled_mm, as on a Hopper GPU
            fp8.emulation_reason = _as_on_hopper
            torch._scaled_mm = lambda *a, **kw: calls.append(a[0].shape) or real_mm(*a, **kw)
        try:
            t = Trainer(small_cfg(f"{tmp}/{name}", "--parallel.tensor=2", "--checkpoint.every=0",
                                  f"--model.linear_backend={backend}", *QWEN_ARGS, steps=steps))  # fmt: skip
            out[name] = [t.train_step() for _ in range(steps)]
        finally:
            fp8.emulation_reason, torch._scaled_mm = real, real_mm
        if t.run_lock is not None:
            t.run_lock.release()
        t.logger.close()
    out["scaled_mm_calls"] = len(calls)
    return out


def test_tensor_parallel_ranks_scale_their_own_shards_on_the_fast_path(tmp_path):
    """With T = 2 each rank quantizes its own weight shards (and the row-parallel layer's partial input): the fast path
    equals the emulation on both ranks, and training follows the unquantized run."""
    for out in run_ranks(2, _tp_losses, str(tmp_path), 4):
        assert out["scaled_mm_calls"] == 4 * 2 * 7 * 3  # steps x blocks x linears (q, k, v, o, gate, up, down) x GEMMs
        assert out["fast"] == pytest.approx(out["emulated"], rel=1e-5), out
        assert out["fast"] != out["torch"] and out["fast"] == pytest.approx(out["torch"], rel=0.02), out
