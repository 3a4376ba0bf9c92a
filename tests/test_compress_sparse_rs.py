"""The sparse codec's reduce-scatter (dilocox/compress/sparse_rs.py) on real gloo ranks, against its plain reference:
the same bits on every rank, the bytes counted on the wire, flat in R where the all-gather's grow, exact resume."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dilocox.compress.collectives import CommStats
from dilocox.compress.compressor import build_compressor
from dilocox.compress.sparse import SparseCompressor
from dilocox.compress.sparse_ref import reference_reduce_scatter
from dilocox.config import load_config
from dilocox.distributed.wire import wire_of
from tests.spawn import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# chunks of 64: 3 rows (the last padded), 5 rows, a 10-element tensor (its own chunk size), an empty one, 2 rows
SHAPES = [torch.Size(s) for s in [(130,), (16, 20), (10,), (0,), (2, 64)]]
CHUNK, DENSITY, BITS, BETA = 64, 0.125, 2, 0.9


def _deltas(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=g) * (0.1 if i % 2 else 1.0) for i, s in enumerate(SHAPES)]


class _Counting:
    """A wire that counts the bytes each call puts on the link (not a member's chunk to itself)."""

    def __init__(self, wire) -> None:
        self.wire, self.sent = wire, 0

    def size(self) -> int:
        return self.wire.size()

    def rank(self) -> int:
        return self.wire.rank()

    def all_gather(self, out, t) -> None:
        self.sent += (self.size() - 1) * t.numel() * t.element_size()
        self.wire.all_gather(out, t)

    def all_to_all_single(self, out, t) -> None:
        self.sent += (self.size() - 1) * t.numel() * t.element_size() // self.size()
        self.wire.all_to_all_single(out, t)


def _syncs(rank: int, world: int, steps: int, collective: str, keep: int = 1):
    comp = SparseCompressor(SHAPES, CHUNK, DENSITY, BITS, BETA, collective, keep)
    comp.block_elems = 2 * CHUNK  # row blocks of 2 chunks: the multi-block path
    wire = _Counting(wire_of(dist.group.WORLD))
    out, snap = [], None
    for t in range(steps):
        st, before = CommStats(), wire.sent
        res = comp.allreduce_mean(_deltas(rank, t), wire, t, st)
        out.append(([r.clone() for r in res], [e.clone() for e in comp.errors], st.bytes_sent, wire.sent - before))
        if t == steps - 2:
            snap = comp.state_dict()
    again = SparseCompressor(SHAPES, CHUNK, DENSITY, BITS, BETA, collective, keep)  # resumed before the last sync
    kept = {k: v.clone() for k, v in (snap.get("owner") or {}).get("rows", {}).items()}
    again.load_state_dict(snap)
    resumed = again.allreduce_mean(_deltas(rank, steps - 1), wire, steps - 1)
    assert all(torch.equal(snap["owner"]["rows"][k], v) for k, v in kept.items())  # the snapshot is not written to
    return out, resumed, comp.wire_bytes(world)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("world,keep", [(2, 1), (3, 1), (4, 1), (4, 2), (3, 8)])  # 8: k' capped at C (short)
def test_the_reduce_scatter_equals_its_reference_on_every_rank(world, keep):
    """Every rank applies the same bits, those of ``reference_reduce_scatter`` (plain per-chunk Python over the codec's
    reference encoder: member error feedback, owner-by-range averaging, the owner's residual and second top-k), sync
    after sync, with a padded last chunk, a short tensor, an empty one and ranges that leave a member no row; each
    rank keeps the reference's error buffers; a resume from the state dict repeats the last sync bit for bit. With
    owner_keep = 2 the owners send 2k entries per chunk of the mean."""
    steps = 3
    res = run_ranks(world, _syncs, steps, "reduce_scatter", keep)
    errors = [[torch.zeros(s) for s in SHAPES] for _ in range(world)]
    residual: dict = {}
    for t in range(steps):
        want = reference_reduce_scatter(
            [_deltas(r, t) for r in range(world)], errors, residual, CHUNK, DENSITY, BITS, BETA, keep
        )
        for r in range(world):
            got, errs, _, _ = res[r][0][t]
            for i in range(len(SHAPES)):
                assert _equal(got[i], want[i]), (t, r, i)
                assert _equal(errs[i], errors[r][i]), (t, r, i)
    for r in range(world):
        assert all(_equal(a, b) for a, b in zip(res[r][1], res[r][0][-1][0])), r


def test_the_bytes_on_the_wire_stay_flat_in_R_where_the_all_gathers_grow():
    """Counted on the wire (both phases, the padding included) = ``wire_bytes`` = what the stats record, on every
    rank; at R = 4 half the all-gather's (2 (R - 1)/R against R - 1 payloads), and per member independent of R up to
    the padding of uneven ranges; the all-gather's grows R - 1 fold."""
    rs = {w: run_ranks(w, _syncs, 2, "reduce_scatter") for w in (2, 4)}
    ag = run_ranks(4, _syncs, 2, "allgather")
    payload = SparseCompressor(SHAPES, CHUNK, DENSITY, BITS, BETA).payload_bytes()
    for w, res in rs.items():
        for r in range(w):
            _, _, stats, counted = res[r][0][0]
            assert stats == counted == res[r][2], (w, r)
    for r in range(4):
        assert ag[r][0][0][2] == ag[r][0][0][3] == 3 * payload
    # this layout: rows per group 10 (C = 64, 9 bytes a row: 8 Rice-coded indices of b = 2 in <= 38 bits, 16 code
    # bits, a bf16 scale) and 1 (C = 10, 4 bytes: its 2 indices stay fixed-width, Rice would not be smaller); R = 4:
    # ranges of 2-3 rows
    assert rs[4][0][2] == 2 * 3 * (3 * 9 + 4)  # the largest range (3 rows + the short tensor's row) padded
    assert rs[4][0][2] < 0.75 * ag[0][0][0][2]
    # owner_keep = 2: the all-gather phase's rows carry 16 entries (13 bytes a row: b = 1, <= 56 bits; the short
    # tensor's 5)
    two = SparseCompressor(SHAPES, CHUNK, DENSITY, BITS, BETA, "reduce_scatter", 2)
    assert two.wire_bytes(4) == 3 * ((3 * 9 + 4) + (3 * 13 + 5))
    keep2 = run_ranks(4, _syncs, 2, "reduce_scatter", 2)
    assert all(keep2[r][0][0][2] == keep2[r][0][0][3] == two.wire_bytes(4) for r in range(4))
    n = 4096 * 64  # a preset-sized shard: the padding is noise, the bytes per member flat in R
    comp = SparseCompressor([torch.Size([n])], 4096, 1 / 128, 2, 0.95, "reduce_scatter")
    per = {w: comp.wire_bytes(w) for w in (2, 4, 8, 16)}
    assert per[2] == comp.payload_bytes()  # R = 2: the all-gather's bytes
    assert per[16] <= 2 * comp.payload_bytes() + 32 * 16
    assert comp.wire_bytes(16) * 7 < SparseCompressor([torch.Size([n])], 4096, 1 / 128, 2, 0.95).wire_bytes(16)


def test_the_owner_residual_is_kept_for_its_member_count_and_rank_only():
    """A changed membership (another R or rank) starts the owner's residual from zero; a checkpoint's residual is
    taken for the same pair only; the config turns the collective on with compress.collective=reduce_scatter."""
    comp = SparseCompressor(SHAPES, CHUNK, DENSITY, BITS, BETA, "reduce_scatter")
    own = comp._owner
    rows = own.take(comp._groups, 3, 1, torch.device("cpu"))
    for r in rows:
        r.fill_(1.0)
    assert all(bool((r == 1).all()) for r in own.take(comp._groups, 3, 1, torch.device("cpu")))
    sd = own.state_dict()
    assert all(bool((r == 0).all()) for r in own.take(comp._groups, 4, 1, torch.device("cpu")))  # R changed
    own.load_state_dict(sd)
    assert all(bool((r == 1).all()) for r in own.take(comp._groups, 3, 1, torch.device("cpu")))
    own.load_state_dict(sd)
    assert all(bool((r == 0).all()) for r in own.take(comp._groups, 3, 2, torch.device("cpu")))  # rank changed
    comp.allreduce_mean(_deltas(0, 0), None, 0)  # (one member: the all-gather's path, the buffers made)
    comp._owner.load_state_dict(sd)
    comp.errors = None  # a heal or a join resets the error buffers (outer/diloco.py): the owner's residual too
    comp.allreduce_mean(_deltas(0, 1), None, 1)
    assert comp._owner.key is None and not comp._owner.rows
    cfg = load_config(
        os.path.join(ROOT, "configs", "methods", "dilocox.yaml"), ["--compress.collective=reduce_scatter"]
    )
    assert build_compressor(cfg.compress, SHAPES, seed=0).collective == "reduce_scatter"
    assert (
        build_compressor(
            load_config(os.path.join(ROOT, "configs", "methods", "dilocox.yaml")).compress, SHAPES, seed=0
        ).collective
        == "allgather"
    )  # auto: the all-gather


def _rs_run(rank, world, tmp, extra, steps, stop):
    from dilocox.train import Trainer
    from tests.test_train import _train_and_resume, tiny_cfg

    t = Trainer(tiny_cfg(f"{tmp}/probe", *extra, "--checkpoint.resume=none", steps=1))
    collectives = [c.collective for c in t.outer.compressors]
    del t
    return collectives, _train_and_resume(rank, world, tmp, extra, steps, stop)


def test_two_replicas_train_and_resume_exactly_through_the_checkpoint(tmp_path):
    """The collective in a real run: 2 replicas of DiLoCo with the sparse codec's reduce-scatter; a run stopped after
    two syncs and resumed follows the uninterrupted one bit for bit (each owner's residual is in the checkpoint: a
    residual restarted from zero changes the next sync's mean)."""
    from tests.test_train import _assert_resume_exact

    extra = [
        "--parallel.replicas=2",
        "--outer.method=diloco",
        "--outer.sync_every=2",
        "--outer.momentum=0",
        "--compress.sparse.enabled=true",
        "--compress.sparse.chunk=64",
        "--compress.collective=reduce_scatter",
    ]
    res = run_ranks(2, _rs_run, str(tmp_path), extra, 8, 5)
    assert [c for c, _ in res] == [["reduce_scatter"]] * 2
    _assert_resume_exact([r for _, r in res])
