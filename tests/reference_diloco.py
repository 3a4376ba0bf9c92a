"""Test oracle: DiLoCo §1–§4 of ALGORITHMS.md in one process, written from the equations.

R replicas are R model copies trained in turn on the same per-replica data as the
distributed run. Nothing here uses dilocox.outer: parameters are kept per name in plain
dicts, the outer optimizer is ``torch.optim.SGD(nesterov=True)`` itself (one instance per
fragment, and per replica in eager mode), and averages are ``torch.stack(...).mean(0)``.

Conventions shared with the implementation (they are part of the spec, not of the code):
inner steps are counted n = 1, 2, ...; fragment p syncs at every n > 0 with
n ≡ p·H/K (mod H) and launches its all-reduce τ steps earlier; layers of a shard are split
``sequential`` (local layer i → ⌊i·K/L⌋) or ``strided`` (i mod K); a parameter with no layer
follows the nearest preceding layered parameter (or the first one). At the end (finish)
every in-flight average is applied with the mode's rule and the replica's params are set
to the outer params.

Also holds the tiny model and the deterministic per-replica data the tests share.
"""

from __future__ import annotations

import torch
from torch import nn

# ---------------------------------------------------------------------------- test fixtures


class TinyNet(nn.Module):
    """Embedding-like input projection, 4 residual "layers", a head: names like a transformer."""

    def __init__(self, d_in: int = 8, d: int = 16, d_out: int = 4, n_layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layers))
        self.head = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


def make_model(seed: int) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def make_inner_opt(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def batch(seed: int, replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + replica * 10_007 + step)
    x = torch.randn(16, 8, generator=g)
    y = torch.sin(x[:, :4] * (1.0 + replica)) + 0.1 * torch.randn(16, 4, generator=g)
    return x, y


def forward_backward(model: nn.Module, seed: int, replica: int, step: int) -> None:
    """Loss of replica ``replica``'s batch of ``step``; gradients accumulate into ``.grad``."""
    x, y = batch(seed, replica, step)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()


# ---------------------------------------------------------------------------- the oracle


def fragment_names(names: list[str], K: int, pattern: str) -> list[list[str]]:
    if K == 1:
        return [list(names)]
    ids = [layer_of(n) for n in names]
    local = sorted({i for i in ids if i is not None})
    L = len(local)
    frag_of = {lid: (j * K // L if pattern == "sequential" else j % K) for j, lid in enumerate(local)}
    out: list[list[str]] = [[] for _ in range(K)]
    current = next(i for i in ids if i is not None)
    for name, lid in zip(names, ids):
        if lid is not None:
            current = lid
        out[frag_of[current]].append(name)
    return out


def _sgd(tensors: list[torch.Tensor], lr: float, momentum: float, nesterov: bool) -> torch.optim.SGD:
    return torch.optim.SGD(tensors, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)


class _MuonOuter:
    """``outer="muon"``: ``torch.optim.Muon`` (no weight decay, Nesterov, its update scaled to AdamW's RMS) on the 2-D
    ``layers.*`` weights of a fragment and ``torch.optim.SGD`` on the rest, two plain optimizers stepped in turn."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], lr: float, momentum: float, nesterov: bool) -> None:
        mats = [t for n, t in named if n.startswith("layers.") and t.dim() == 2]
        rest = [t for n, t in named if not (n.startswith("layers.") and t.dim() == 2)]
        self.opts = [
            torch.optim.Muon(
                mats, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"
            )
        ] + ([_sgd(rest, lr, momentum, nesterov)] if rest else [])
        self.state: dict = {}

    def step(self) -> None:
        for o in self.opts:
            o.step()


def _outer(named: list[tuple[str, torch.Tensor]], lr: float, momentum: float, nesterov: bool, kind: str):
    if kind == "muon":
        return _MuonOuter(named, lr, momentum, nesterov)
    return _sgd([t for _, t in named], lr, momentum, nesterov)


def _outer_update(opt: torch.optim.SGD, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def run_reference(
    R: int,
    steps: int,
    seed: int,
    H: int,
    overlap: str = "none",
    K: int = 1,
    tau: int = 0,
    alpha: float = 0.5,
    pattern: str = "sequential",
    lr: float = 0.7,
    momentum: float = 0.9,
    nesterov: bool = True,
    inner: str = "adamw",
    members: list[list[int]] | None = None,
    fresh_inner: dict[int, list[int]] | None = None,
    sparse: dict | None = None,
    lookahead: float = 0.0,
    rejoin: dict[int, list[int]] | None = None,
    outer: str = "sgd",
    merge: str = "mix",
) -> list[dict[str, torch.Tensor]]:
    """Train R replicas for ``steps`` inner steps with the outer rule; return final params per replica.

    Elastic runs: ``members[t - 1]`` are the replicas whose pseudo-gradients the average of outer round t is
    taken over (rounds in launch order: every fragment's all-reduce is one; the others keep training here but are
    left out: dead, or healing); ``fresh_inner[t]`` (K = 1) lists replicas whose inner optimizer restarts from
    scratch after sync t (a replica that joined the run there: it starts from θ like everyone, with a new AdamW).
    ``rejoin[t]`` (overlap none, any K and tau): replicas that join in round t: right after that round's average
    is taken (at its launch, tau steps before its sync), ALL their params start from θ, with a new AdamW; the
    round's sync then treats them like everyone (mixing with α when streaming).

    ``sparse`` = dict(chunk, density, bits, ef_decay) (any K and tau): the average is SparseLoCo's
    (compress/sparse.py): per replica and tensor (a fragment's tensors at that fragment's syncs) e = β e + Δ,
    the chunked top-k payload in plain loops (``reference_encode``), what it decodes to is sent and taken out
    of e; the mean is the sum of the decoded payloads in replica order / R.

    ``lookahead`` = γ (overlap delayed): after each outer step the replicas start from θ − γ·lr·v (v: the outer SGD's
    momentum buffer) and the pseudo-gradient is taken from that start: Δ = θ − γ·lr·v − θ_m.

    ``outer`` = "muon": the outer optimizer is Muon on the layers' matrices and SGD on the rest (``_MuonOuter``).

    ``merge`` = "replay" (streaming, overlap none): each replica keeps its params at a round's launch, w0; at the
    round's sync w ← w + (1 − α)(θ − w0) (the mix from w0, then the steps since added back)."""
    models = [make_model(seed) for _ in range(R)]
    opts = [make_inner_opt(m, inner) for m in models]
    names = [n for n, _ in models[0].named_parameters()]
    frags = fragment_names(names, K, pattern)
    streaming = K > 1 or tau > 0
    mix = alpha if (streaming and overlap == "none") else 0.0
    w = [dict(m.named_parameters()) for m in models]  # live replica params θ_m
    n_outer = R if overlap == "eager" else 1  # eager: θ and v per replica
    theta = [{n: w[0][n].detach().clone() for n in names} for _ in range(n_outer)]
    outer_opt = [
        [_outer([(n, theta[r][n]) for n in frags[p]], lr, momentum, nesterov, outer) for p in range(K)]
        for r in range(n_outer)
    ]
    pending: list[list[torch.Tensor] | None] = [None] * K  # none: launched average; delayed/eager: Δ̄^{t−1}
    own_prev: list[list[list[torch.Tensor] | None]] = [[None] * K for _ in range(R)]
    at_launch: list[list[dict | None]] = [[None] * K for _ in range(R)]  # merge=replay: params at the launch

    def is_sync(p: int, n: int) -> bool:
        return n > 0 and n % H == (p * H // K) % H

    shift = lookahead * lr if overlap == "delayed" else 0.0

    def v(p: int, n: str) -> torch.Tensor:
        st = outer_opt[0][p].state.get(theta[0][n], {})
        buf = st.get("momentum_buffer")
        return torch.zeros_like(theta[0][n]) if buf is None else buf

    def start(m: int, p: int, n: str) -> torch.Tensor:
        th = theta[m if n_outer > 1 else 0][n]
        return th - shift * v(p, n) if shift else th

    def deltas(p: int) -> list[list[torch.Tensor]]:
        return [[start(m, p, n) - w[m][n].detach() for n in frags[p]] for m in range(R)]

    n_sync = [0]  # outer syncs so far (K = 1 with members)

    ef: list[dict[str, torch.Tensor]] = [{} for _ in range(R)]  # sparse: the error buffer per replica and tensor

    def sparse_mean(ds: list[list[torch.Tensor]], p: int) -> list[torch.Tensor]:
        from dilocox.compress.sparse_ref import reference_decode, reference_encode

        assert members is None, "the sparse oracle is for a fixed membership"
        sp = sparse
        out = [torch.zeros(d.numel()) for d in ds[0]]
        for m in range(R):
            for j, (name, d) in enumerate(zip(frags[p], ds[m])):
                e = ef[m].get(name, torch.zeros_like(d)) * sp["ef_decay"] + d.float()
                payload = reference_encode(e, sp["chunk"], sp["density"], sp["bits"])
                sent = reference_decode(payload, d.numel(), sp["chunk"], sp["density"], sp["bits"])
                ef[m][name] = e - sent.view(d.shape)
                out[j] = out[j] + sent
        return [(o / R).view(d.shape) for o, d in zip(out, ds[0])]

    def mean(ds: list[list[torch.Tensor]], p: int) -> list[torch.Tensor]:
        if sparse is not None:
            return sparse_mean(ds, p)
        who = range(R) if members is None else members[n_sync[0] - 1]
        return [torch.stack([ds[m][j] for m in who]).mean(0) for j in range(len(ds[0]))]

    def load(p: int, m: int, a: float, final: bool = False) -> None:
        th = theta[m if n_outer > 1 else 0]
        with torch.no_grad():
            for n in frags[p]:
                w[m][n].copy_(a * w[m][n] + (1 - a) * (th[n] if final else start(m, p, n)))

    with torch.no_grad():
        for step in range(steps):
            with torch.enable_grad():
                for m in range(R):
                    forward_backward(models[m], seed, m, step)
                    opts[m].step()
                    opts[m].zero_grad()
            n = step + 1
            for p in range(K):
                if overlap == "none":
                    if is_sync(p, n + tau):
                        n_sync[0] += 1  # (a round: one fragment's all-reduce)
                        pending[p] = mean(deltas(p), p)
                        if merge == "replay":
                            assert not rejoin, "rejoin is modelled for merge=mix"
                            for m in range(R):
                                at_launch[m][p] = {x: w[m][x].detach().clone() for x in frags[p]}
                        for m in (rejoin or {}).get(n_sync[0], []):
                            for x in names:
                                w[m][x].copy_(theta[0][x])
                            opts[m] = make_inner_opt(models[m], inner)
                    if is_sync(p, n):
                        _outer_update(outer_opt[0][p], [theta[0][x] for x in frags[p]], pending[p])
                        pending[p] = None
                        for m in range(R):
                            if merge == "replay":
                                for x in frags[p]:
                                    w[m][x].add_((1 - mix) * (theta[0][x] - at_launch[m][p][x]))
                            else:
                                load(p, m, mix)
                elif is_sync(p, n):
                    assert not rejoin, "rejoin is modelled for overlap none"
                    n_sync[0] += 1
                    ds = deltas(p)
                    prev = pending[p] if pending[p] is not None else [torch.zeros_like(d) for d in ds[0]]
                    pending[p] = mean(ds, p)
                    for m in range(n_outer):
                        if overlap == "eager":
                            own = own_prev[m][p] or [torch.zeros_like(d) for d in ds[m]]
                            g = [pv + (d - o) / R for pv, d, o in zip(prev, ds[m], own)]
                            own_prev[m][p] = ds[m]
                        else:
                            g = prev
                        _outer_update(outer_opt[m][p], [theta[m][x] for x in frags[p]], g)
                    for m in range(R):
                        load(p, m, 0.0)
            for m in (fresh_inner or {}).get(n_sync[0], []) if n % H == 0 else []:
                opts[m] = make_inner_opt(models[m], inner)
        # finish: apply what is in flight, then every replica takes the outer params
        for p in range(K):
            if pending[p] is None:
                continue
            for m in range(n_outer):
                g = pending[p]
                if overlap == "eager":
                    g = [a - o / R for a, o in zip(g, own_prev[m][p])]
                _outer_update(outer_opt[m][p], [theta[m][x] for x in frags[p]], g)
        for p in range(K):
            for m in range(R):
                load(p, m, 0.0, final=True)
    return [{n: t.detach().clone() for n, t in w[m].items()} for m in range(R)]
