"""GPU checks (marker ``cuda``; ``make test-gpu``): every CUDA path against its CPU reference.

The rest of the suite is the CPU suite (gloo ranks, fp32, bit-exact oracles) and hides any GPU
(tests/conftest.py); ``make test-gpu`` sets ``DILOCOX_TEST_GPU=1`` and runs only the tests marked
``cuda`` with the GPU visible. Without a CUDA device every test here skips.

What is compared (the same seed gives the same initial weights on both devices: the init draws on a
CPU generator, model/transformer.py):
- one-rank fp32 training on the GPU follows the CPU run of the same config step by step;
- bf16 autocast training (``train.dtype=auto`` on a GPU) ends near the fp32 run; ``train.compile`` trains as eager;
- the outer step of the compressed methods (DiLoCoX's low-rank + int4 with the CUDA kernel and the
  one-step delay, SparseLoCo's top-k 2-bit codec, Streaming DiLoCo's fragments) on the GPU follows
  the CPU run; the outer state on the device equals it on the host;
- the fp8 forward GEMM (``torch._scaled_mm``) equals its fp32 emulation; so do the two backward GEMMs of
  ``model.linear_backend=fp8_all`` (e5m2 gradient) and the forward, each within the tensor cores' accumulation;
- the int4/int8 CUDA kernels equal the CPU reference bit for bit at a size that spans many blocks.
"""

from __future__ import annotations

import os

import pytest
import torch

from dilocox.bench.runner import CONFIGS, run_train

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu on a GPU machine)"),
]


def _losses(tmp_path, name: str, config: str, device: str, *overrides: str, steps: int = 20) -> list[float]:
    res = run_train(
        os.path.join(CONFIGS, config),
        1,
        str(tmp_path / name),
        [f"--train.device={device}", f"--train.steps={steps}", "--train.eval_every=0", *overrides],
        timeout=600,
    )
    losses = [r["loss"] for r in res["steps"] if "loss" in r]
    assert len(losses) == steps, f"{name}: {len(losses)} loss records for {steps} steps"
    return losses


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_fp32_training_on_the_gpu_follows_the_cpu_run(tmp_path):
    cpu = _losses(tmp_path, "cpu", "tiny.yaml", "cpu", "--train.dtype=fp32")
    gpu = _losses(tmp_path, "gpu", "tiny.yaml", "cuda", "--train.dtype=fp32")
    assert abs(cpu[0] - gpu[0]) / cpu[0] < 1e-5, (cpu[0], gpu[0])  # same weights, same batch
    assert _max_rel(gpu, cpu) < 2e-3, list(zip(cpu, gpu))


def test_bf16_autocast_training_ends_near_fp32(tmp_path):
    fp32 = _losses(tmp_path, "fp32", "tiny.yaml", "cuda", "--train.dtype=fp32", steps=80)
    bf16 = _losses(tmp_path, "bf16", "tiny.yaml", "cuda", "--train.dtype=auto", steps=80)
    tail = lambda ls: sum(ls[-10:]) / 10  # noqa: E731
    assert tail(bf16) < bf16[0] - 1.0, "bf16 training did not learn"
    assert abs(tail(bf16) - tail(fp32)) / tail(fp32) < 0.03, (tail(bf16), tail(fp32))
    assert bf16 != fp32  # autocast did run in bf16


def test_compiled_blocks_train_as_the_eager_model(tmp_path):
    eager = _losses(tmp_path, "eager", "tiny.yaml", "cuda", "--train.dtype=fp32")
    compiled = _losses(tmp_path, "compiled", "tiny.yaml", "cuda", "--train.dtype=fp32", "--train.compile=true")
    assert _max_rel(compiled, eager) < 2e-3, list(zip(eager, compiled))
    from dilocox.checkpoint.full import full_tensors

    sd = full_tensors(str(next((tmp_path / "compiled" / "checkpoints").glob("step_*[0-9]"))), "replica0/model")
    assert "layers.0.attn.q_proj.weight" in sd  # compiled in place: the checkpoint keys are the same


ONE_REPLICA = ["--parallel.replicas=1", "--parallel.pipeline=1", "--parallel.microbatches=1", "--train.dtype=fp32"]
METHODS = {
    # DiLoCoX as the paper describes it: low-rank + int4 (the CUDA kernel) + error feedback + one-step delay; fixed
    # rank and H (the adaptive controller measures wall-clock time, which differs between the devices)
    "dilocox-paper": ["--outer.sync_every=5", "--compress.adaptive.enabled=false"],
    "dilocox": ["--outer.sync_every=4"],  # 2 fragments, tau = 1, the sparse codec
    "sparseloco": ["--outer.sync_every=5"],  # top-k of chunks, 2-bit values, error feedback
    "streaming-sparse": ["--outer.sync_every=6"],  # 2 fragments, tau = 2, the sparse codec
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_compressed_outer_step_on_the_gpu_follows_the_cpu_run(tmp_path, method):
    config = tmp_path / f"{method}.yaml"
    preset = os.path.join(CONFIGS, "methods", f"{method}.yaml")
    config.write_text(f"include: [{os.path.join(CONFIGS, 'tiny.yaml')}, {preset}]\n")
    args = [*ONE_REPLICA, *METHODS[method]]
    cpu = _losses(tmp_path, "cpu", str(config), "cpu", *args)
    gpu = _losses(tmp_path, "gpu", str(config), "cuda", *args, "--outer.state_device=host")  # (a preset may say device)
    assert _max_rel(gpu, cpu) < 5e-3, list(zip(cpu, gpu))
    dev = _losses(tmp_path, "gpu-state", str(config), "cuda", *args, "--outer.state_device=device")
    assert _max_rel(dev, gpu) < 1e-4, list(zip(gpu, dev))


def test_fp8_scaled_mm_equals_its_emulation():
    from dilocox.model.fp8 import fp8_linear, fp8_supported

    dev = torch.device("cuda")
    if not fp8_supported(dev):
        pytest.skip("fp8 GEMMs need compute capability >= 8.9")
    g = torch.Generator().manual_seed(0)
    for m in (64, 50):  # 50: the padded path (_scaled_mm wants multiples of 16)
        x = (torch.randn(m, 256, generator=g) * 3).to(dev)
        w = (torch.randn(384, 256, generator=g) * 0.02).to(dev)
        b = torch.randn(384, generator=g).to(dev)
        fast = fp8_linear(x, w, b, emulate=False)
        ref = fp8_linear(x, w, b, emulate=True)
        assert fast.dtype == ref.dtype == torch.float32
        # the same fp8 operands; only the accumulation differs (Hopper's fp8 tensor cores accumulate with fewer
        # mantissa bits than fp32; measured on an H200: 1.9e-4 of the largest output at worst)
        assert (fast - ref).abs().max() < 1e-3 * ref.abs().max(), (fast - ref).abs().max()
        assert (fast - ref).norm() < 1e-4 * ref.norm(), (fast - ref).norm() / ref.norm()
        exact = x @ w.t() + b
        assert (fast - exact).norm() / exact.norm() > 1e-4  # it did run in fp8
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fp8_linear(x, w, b, emulate=False)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_fp8_all_three_gemms_equal_their_emulation():
    from dilocox.model.fp8 import fp8_linear_all, fp8_supported

    dev = torch.device("cuda")
    if not fp8_supported(dev):
        pytest.skip("fp8 GEMMs need compute capability >= 8.9")
    g = torch.Generator().manual_seed(1)
    for m in (64, 50):
        x, w = torch.randn(m, 256, generator=g) * 3, torch.randn(384, 256, generator=g) * 0.02
        b = torch.randn(384, generator=g)
        dy = (torch.randn(m, 384, generator=g) * 1e-3).to(dev)
        out = {}
        for emulate in (False, True):
            xx, ww, bb = (t.to(dev).requires_grad_() for t in (x, w, b))
            y = fp8_linear_all(xx, ww, bb, emulate=emulate)
            y.backward(dy)
            out[emulate] = (y.detach(), xx.grad, ww.grad)
        # the forward GEMM accumulates fast (Hopper keeps ~14 bits of its fp8 sums: DeepSeek-V3's report, 3.3.2), as
        # torchao's recipe does; the two gradient GEMMs promote to fp32 like the fp8 test above
        for name, fast, ref, tol in zip(("y", "dX", "dW"), out[False], out[True], (1e-2, 1e-3, 1e-3)):
            assert (fast - ref).abs().max() < tol * ref.abs().max(), (name, (fast - ref).abs().max())


def test_cuda_kernels_equal_the_cpu_reference_across_many_blocks():
    from dilocox.compress import kernels
    from dilocox.compress.quant import dequantize_accumulate, quantize

    if not kernels.have_extension("cuda"):
        pytest.skip("dilocox._C_cuda is not built (python setup.py build_ext --inplace with a CUDA torch)")
    n = (1 << 24) + 37
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=g) * 1e-2
    e = torch.randn(n, generator=g) * 1e-3
    for kind in ("int4", "int8"):
        for sr in (False, True):
            ec, er = e.cuda(), e.clone()
            pc = quantize(x.cuda(), kind, 128, error=ec, stochastic=sr, seed=9, step=4)
            pr = quantize(x, kind, 128, error=er, stochastic=sr, seed=9, step=4, use_kernel=False)
            assert torch.equal(pc.data.cpu(), pr.data), (kind, sr)
            assert torch.equal(ec.cpu().view(torch.int32), er.view(torch.int32)), (kind, sr)
            base = torch.linspace(-1, 1, n)
            dc = dequantize_accumulate(pc, base.cuda()).cpu()
            dr = dequantize_accumulate(pr, base.clone(), use_kernel=False)
            assert torch.equal(dc.view(torch.int32), dr.view(torch.int32)), (kind, sr)
