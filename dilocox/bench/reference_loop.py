"""The plain side of ``dilocox bench train --reference`` and the counters both sides are measured with.

The reference loop imports no dilocox module (that is its point): a nanoGPT-shaped model (fused QKV, SDPA,
F.cross_entropy inside the compiled forward) built from plain numbers (:class:`RefShape`), AdamW (fused on CUDA,
foreach on CPU), foreach clipping, ``torch.compile`` of the whole model. :func:`load_dilocox_weights` copies a dilocox
state dict into it (both compute the same function). The counters: host syncs per step (:class:`SyncCounter`),
kernel launches per step (CUDA, torch.profiler), graph breaks (``torch._dynamo`` counters). The bench driver, its
sides and its report: :mod:`dilocox.bench.reference`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


# --------------------------------------------------------------------------- the reference model (no dilocox)
@dataclass
class RefShape:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_ff: int
    vocab_size: int
    max_seq_len: int
    norm: str = "layernorm"  # layernorm | rmsnorm
    activation: str = "gelu"  # gelu | relu | swiglu
    pos_emb: str = "learned"  # learned | rope
    bias: bool = True
    qkv_bias: bool = True
    eps: float = 1e-5
    rope_theta: float = 10000.0


def _norm(s: RefShape) -> nn.Module:
    return nn.RMSNorm(s.d_model, eps=s.eps) if s.norm == "rmsnorm" else nn.LayerNorm(s.d_model, eps=s.eps)


class RefBlock(nn.Module):
    def __init__(self, s: RefShape):
        super().__init__()
        self.s, hd = s, s.d_model // s.n_heads
        self.ln_1, self.ln_2 = _norm(s), _norm(s)
        self.qkv = nn.Linear(s.d_model, (s.n_heads + 2 * s.n_kv_heads) * hd, bias=s.qkv_bias)  # one GEMM
        self.proj = nn.Linear(s.n_heads * hd, s.d_model, bias=s.bias)
        up = 2 * s.d_ff if s.activation == "swiglu" else s.d_ff  # SwiGLU: gate and up in one GEMM
        self.fc = nn.Linear(s.d_model, up, bias=s.bias)
        self.down = nn.Linear(s.d_ff, s.d_model, bias=s.bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        s, (b, t, _) = self.s, x.shape
        hd = s.d_model // s.n_heads
        q, k, v = self.qkv(self.ln_1(x)).split([s.n_heads * hd, s.n_kv_heads * hd, s.n_kv_heads * hd], dim=-1)
        q, k, v = q.view(b, t, -1, hd), k.view(b, t, -1, hd), v.view(b, t, -1, hd)
        if rope is not None:
            q, k = _rope(q, *rope), _rope(k, *rope)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=s.n_kv_heads != s.n_heads,
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, s.n_heads * hd))
        h = self.fc(self.ln_2(x))
        if s.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh") if s.activation == "gelu" else F.relu(h)
        return x + self.down(h)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class RefGPT(nn.Module):
    """A decoder-only transformer in the usual single-GPU form; ``forward(idx, targets)`` returns the mean loss."""

    def __init__(self, s: RefShape):
        super().__init__()
        self.s = s
        self.wte = nn.Embedding(s.vocab_size, s.d_model)
        self.wpe = nn.Embedding(s.max_seq_len, s.d_model) if s.pos_emb == "learned" else None
        self.blocks = nn.ModuleList(RefBlock(s) for _ in range(s.n_layers))
        self.ln_f = _norm(s)
        self.head = nn.Linear(s.d_model, s.vocab_size, bias=False)
        if s.pos_emb == "rope":
            hd = s.d_model // s.n_heads
            inv = 1.0 / s.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
            f = torch.outer(torch.arange(s.max_seq_len, dtype=torch.float32), inv)
            emb = torch.cat([f, f], dim=-1).unsqueeze(1)
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(t, device=idx.device))
        rope = (self.cos[:t], self.sin[:t]) if self.wpe is None else None
        for block in self.blocks:
            x = block(x, rope)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def load_dilocox_weights(ref: RefGPT, full_sd: dict[str, torch.Tensor]) -> None:
    """Copy a dilocox 1-process state dict (``StageModel.state_dict()``) into the reference's layout
    (q/k/v -> one qkv, gate/up -> one fc): both compute the same function afterwards."""
    sd = {k: v for k, v in full_sd.items()}
    out = {"wte.weight": sd["embed.weight"], "ln_f.weight": sd["norm_f.weight"], "head.weight": sd["head.weight"]}
    if "pos_embed.weight" in sd:
        out["wpe.weight"] = sd["pos_embed.weight"]
    if "norm_f.bias" in sd:
        out["ln_f.bias"] = sd["norm_f.bias"]
    for i in range(ref.s.n_layers):
        p, q = f"layers.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            for n in ("ln_1", "ln_2"):
                if p + f"{n}.{kind}" in sd:
                    out[q + f"{n}.{kind}"] = sd[p + f"{n}.{kind}"]
            if p + f"attn.q_proj.{kind}" in sd:
                out[q + f"qkv.{kind}"] = torch.cat([sd[p + f"attn.{n}_proj.{kind}"] for n in "qkv"])
            if p + f"attn.o_proj.{kind}" in sd:
                out[q + f"proj.{kind}"] = sd[p + f"attn.o_proj.{kind}"]
            if p + f"mlp.up_proj.{kind}" in sd:
                parts = ["gate_proj", "up_proj"] if ref.s.activation == "swiglu" else ["up_proj"]
                out[q + f"fc.{kind}"] = torch.cat([sd[p + f"mlp.{n}.{kind}"] for n in parts])
            if p + f"mlp.down_proj.{kind}" in sd:
                out[q + f"down.{kind}"] = sd[p + f"mlp.down_proj.{kind}"]
    ref.load_state_dict(out)


def ref_shape(mcfg) -> RefShape:
    """The reference's shape from a dilocox ``ModelConfig`` (plain numbers; the reference imports nothing else)."""
    if mcfg.subspace_rank or mcfg.tie_embeddings or mcfg.dropout:
        raise ValueError("the reference loop has no subspace constraint, tied embeddings or dropout")
    return RefShape(
        n_layers=mcfg.n_layers,
        n_heads=mcfg.n_heads,
        n_kv_heads=mcfg.kv_heads,
        d_model=mcfg.d_model,
        d_ff=mcfg.ffn_dim,
        vocab_size=mcfg.vocab_size,
        max_seq_len=mcfg.max_seq_len,
        norm=mcfg.norm,
        activation=mcfg.activation,
        pos_emb=mcfg.pos_emb,
        bias=mcfg.bias,
        qkv_bias=mcfg.bias if mcfg.qkv_bias is None else mcfg.qkv_bias,
        eps=mcfg.norm_eps,
        rope_theta=mcfg.rope_theta,
    )


class ReferenceLoop:
    """The plain training loop: AdamW (weight decay on matrices only), clipping, bf16 autocast on CUDA."""

    def __init__(self, shape: RefShape, device, *, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 grad_clip=1.0, compile=False, autocast=None, weights=None):  # fmt: skip
        self.device = torch.device(device)
        self.model = RefGPT(shape).to(self.device)
        if weights is not None:
            load_dilocox_weights(self.model, weights)
        params = list(self.model.parameters())
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        fast = {"fused": True} if self.device.type == "cuda" else {"foreach": True}
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **fast)
        self.params, self.grad_clip, self.autocast = params, grad_clip, autocast
        self.fwd = torch.compile(self.model) if compile else self.model
        self.step_count = 0

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float | None = None) -> torch.Tensor:
        if lr is not None:
            for g in self.opt.param_groups:
                g["lr"] = lr
        ctx = torch.autocast(self.device.type, dtype=self.autocast) if self.autocast else contextlib.nullcontext()
        with ctx:
            loss = self.fwd(x, y)
        loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_count += 1
        return loss.detach()


# --------------------------------------------------------------------------- measuring
# where a CPU tensor is host data by construction (the batch is drawn there, before its copy to the device); on a CPU
# run every tensor is a host tensor, so these callers are told apart by their file
HOST_SIDE = (os.path.join("dilocox", "data", ""),)
SYNC_WINDOW = 20  # steps over which host syncs are counted (two log periods of 10), apart from the timed ones
_SYNC_METHODS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__")


class SyncCounter:
    """Counts the calls that make the host wait for the device: ``Tensor.item/tolist/numpy``, ``float()/int()/bool()``
    of a tensor, ``.cpu()`` / ``.to("cpu")`` of a device tensor, ``torch.cuda.synchronize``. Not counted: calls on a
    tensor in ``exempt`` (the optimizer's step counters, which torch keeps on the host by design), calls made by the
    data pipeline on its host tensors (:data:`HOST_SIDE`), calls made while torch.compile traces. So on a CPU run,
    where no call waits for anything, it still counts every call that would make the host wait on a GPU. On CUDA,
    torch's own sync debug mode is counted too (``cuda``):
    it also sees the syncs inside torch (a pageable copy, a nonzero). ``calls`` names the first caller of each."""

    def __init__(self, exempt=()):
        self.count, self.cuda, self.calls = 0, 0, {}
        self.exempt = {id(t) for t in exempt}
        self._saved: list = []

    def _hit(self, what: str) -> None:
        import traceback

        self.count += 1
        frames = traceback.extract_stack()[:-2]  # without this frame and the wrapper
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        self.calls[f"{what} at {where}"] = self.calls.get(f"{what} at {where}", 0) + 1

    def _wrap(self, name, fn):
        counter = self

        def wrapped(t, *a, **kw):
            caller = sys._getframe(1).f_code.co_filename
            host_data = t.device.type == "cpu" and any(p in caller for p in HOST_SIDE)
            if id(t) not in counter.exempt and not host_data and not torch.compiler.is_compiling():
                to_host = name not in ("cpu", "to") or (
                    t.device.type != "cpu" and (name == "cpu" or "cpu" in str(a[:1]) + str(kw.get("device", "")))
                )
                if to_host:
                    counter._hit(name)
            return fn(t, *a, **kw)

        return wrapped

    def __enter__(self) -> SyncCounter:
        for name in (*_SYNC_METHODS, "cpu", "to"):
            fn = getattr(torch.Tensor, name)
            self._saved.append((torch.Tensor, name, fn))
            setattr(torch.Tensor, name, self._wrap(name, fn))
        if torch.cuda.is_available():
            sync = torch.cuda.synchronize
            self._saved.append((torch.cuda, "synchronize", sync))

            def cuda_sync(*a, **kw):
                self._hit("torch.cuda.synchronize")
                return sync(*a, **kw)

            torch.cuda.synchronize = cuda_sync
            self._debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(1)  # warn: one warning per synchronizing call inside torch
            self._warnings = warnings.catch_warnings(record=True)
            self._records = self._warnings.__enter__()
            warnings.simplefilter("always")  # inside the context: restored on exit
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(self._debug_mode)
            self.cuda = sum("synchroniz" in str(w.message) for w in self._records)
            self._warnings.__exit__(*exc)


def optimizer_step_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [s["step"] for s in opt.state.values() if isinstance(s.get("step"), torch.Tensor)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kernel_launches(device: torch.device, fn, steps: int) -> float | None:
    """Kernel launches per step of ``fn`` (torch.profiler's CUDA runtime events); None off CUDA."""
    if device.type != "cuda" or steps <= 0:
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        _sync(device)
    n = sum(e.count for e in prof.key_averages() if "LaunchKernel" in e.key or "GraphLaunch" in e.key)
    return n / steps


def _reset_dynamo() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _graph_break_count() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))
