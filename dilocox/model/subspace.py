"""A residual stream confined to a fixed low-dimensional subspace (``model.subspace_rank: k``; issue 24).

The idea of Subspace Networks (Ramasinghe et al., "Protocol Models: Scaling Decentralized Training with
Communication-Efficient Model Parallelism", arXiv 2506.01260): in a pre-norm transformer the hidden state after
layer l is ``x_l = x_0 + sum of what the blocks wrote``. If every write into the residual stream lies in one
subspace ``S = span(U)`` (``U``: d x k, orthonormal columns) and the embedding is a FIXED part every process can
rebuild from the token ids plus a trainable part in ``S``, then

    x_l = x0(tokens) + U c_l,        c_l in R^k per token,

so a pipeline stage boundary needs only the k coefficients ``c = U^T (x - x0)`` forward (the receiver rebuilds
``x = x0 + U c`` exactly), and backward only ``U^T g``: the sender's parameters reach ``x`` through ``U c`` alone, so
``U U^T g`` gives them exactly the gradient ``g`` would (``dilocox.swarm.activations``, kinds ``subspace*``).
That is d/k fewer values both ways, with nothing lost; the cost is the constraint on the model.

What changes in the model (``dilocox.model.transformer``), with ``k = model.subspace_rank``:

* the residual out-projections (``attn.o_proj``, ``mlp.down_proj``) produce k values, expanded by ``U``
  (weight ``[k, in]``, bias ``[k]``; as a dense layer: ``W = U A``, ``b = U beta``);
* the token embedding is ``E0[token] + U B[token]`` with ``E0`` [V, d] fixed and ``B`` [V, k] trained
  (``embed.weight``); a learned position embedding likewise ``P0[pos] + U C[pos]``;
* everything else (norms, q/k/v, up/gate projections, the head) is unchanged and reads the full d-dim stream;
* ``model.subspace_layers`` = N: only the first N layers are constrained. A stage boundary after layer l is exact
  when every layer up to l is; the layers after the last boundary of a pipeline need not be (they write
  full-rank into a stream nothing sends on), which costs the model less.

``U``, ``E0`` and ``P0`` are functions of the model's shape alone (seeded by a fixed label, not by
``train.seed``), so every process of every stage builds the same ones without a message: not parameters, not
buffers (nothing a meta-device build or a checkpoint load could leave unset), never checkpointed, never synced;
built once per device and dtype and cached (``_on``). ``U`` is the Q factor of a seeded Gaussian matrix (the
paper predefines the subspace; it is not learned here). ``E0``/``P0`` are N(0, init_std) like GPT-2's embedding
init.

``dense_state_dict`` turns a full state dict of such a model into the state dict of the plain model with the
same function (``W = U A``, ``wte = E0 + B U^T``, ...), which is how a subspace model is exported to Hugging Face.
Dropout (elementwise masks leave the subspace), tied embeddings and ``init_from`` are refused with the constraint
(``dilocox.config.checks.check_subspace``).
"""

from __future__ import annotations

import functools

import torch

from dilocox.seeding import text_seed

# the parameters whose shape and meaning change under the constraint (names as in the full state dict)
OUT_PROJ = ("attn.o_proj", "mlp.down_proj")


def _gen(label: str) -> torch.Generator:
    return torch.Generator().manual_seed(text_seed(f"dilocox.subspace/{label}"))


@functools.lru_cache(maxsize=8)
def _basis_cpu(d: int, k: int) -> torch.Tensor:
    if not 0 < k < d:
        raise ValueError(f"model.subspace_rank={k} must be in [1, d_model={d}) (0 turns the constraint off)")
    g = torch.randn(d, k, generator=_gen(f"basis/{d}/{k}"), dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # a unique Q (positive diagonal of R)
    return q.to(torch.float32).contiguous()


@functools.lru_cache(maxsize=32)
def _on(what: str, shape: tuple, device: str, dtype: torch.dtype, std: float = 0.0) -> torch.Tensor:
    """The fixed tensors, built once per (device, dtype): a forward never copies them again."""
    t = _basis_cpu(*shape) if what == "basis" else _fixed_cpu(*shape, std, what)
    return t.to(device=device, dtype=dtype)


def basis(d: int, k: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """``U`` [d, k]: orthonormal columns, the same in every process for the same (d, k)."""
    return _on("basis", (int(d), int(k)), str(torch.device(device or "cpu")), dtype)


@functools.lru_cache(maxsize=8)
def _fixed_cpu(rows: int, d: int, std: float, what: str) -> torch.Tensor:
    return torch.empty(rows, d).normal_(0.0, std, generator=_gen(f"{what}/{rows}/{d}/{std!r}"))


def fixed_embedding(mcfg, device=None, dtype=torch.float32) -> torch.Tensor:
    """``E0`` [vocab_size, d_model]: the fixed part of the token embedding."""
    dev = str(torch.device(device or "cpu"))
    return _on("embed", (mcfg.vocab_size, mcfg.d_model), dev, dtype, float(mcfg.init_std))


def fixed_positions(mcfg, device=None, dtype=torch.float32) -> torch.Tensor:
    """``P0`` [max_seq_len, d_model]: the fixed part of a learned position embedding."""
    dev = str(torch.device(device or "cpu"))
    return _on("pos", (mcfg.max_seq_len, mcfg.d_model), dev, dtype, float(mcfg.init_std))


def stream_base(mcfg, tokens: torch.Tensor, device=None, dtype=torch.float32) -> torch.Tensor:
    """``x0(tokens)`` [B, S, d]: the part of every hidden state that the token ids alone determine."""
    e = fixed_embedding(mcfg, device, dtype)[tokens.to(device=device, dtype=torch.long)]
    if mcfg.pos_emb == "learned":
        e = e + fixed_positions(mcfg, device, dtype)[: tokens.shape[-1]]
    return e


@torch.no_grad()
def dense_state_dict(mcfg, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's full state dict with the same function as the subspace model's ``full`` (module doc)."""
    k = mcfg.subspace_rank
    if not k:
        return dict(full)
    U = basis(mcfg.d_model, k, dtype=torch.float64)
    out = {}
    for name, t in full.items():
        t64 = t.to(torch.float64)
        owner = name.rsplit(".", 1)[0]
        # a constrained out-projection has k outputs (k < d_model); the unconstrained layers' have d_model
        if any(owner.endswith(p) for p in OUT_PROJ) and t.shape[0] == k:
            out[name] = U @ t64  # weight [d, in] from [k, in]; bias [d] from [k]
        elif name == "embed.weight":
            out[name] = fixed_embedding(mcfg, dtype=torch.float64) + t64 @ U.T
        elif name == "pos_embed.weight":
            out[name] = fixed_positions(mcfg, dtype=torch.float64) + t64 @ U.T
        else:
            out[name] = t64
        out[name] = out[name].to(t.dtype).contiguous()
    return out
