"""Two accounting checks after the preflight / FixedGroup ones (tests/test_suspicions_a.py): the free-space check of
each save takes the whole checkpoint (every rank's share of it, as preflight does), not one rank's state; and the
elastic ``QuorumGroup`` counts in ``bytes_sent`` the count all-reduce it runs beside a codec's collectives (the
contributors' one-hot, the H proposals, outer.norm_check's norms), as FixedGroup counts its side collectives."""

from __future__ import annotations

import os

import pytest
import torch

from tests.spawn import run_ranks


# ------------------------------------------------------------------------------- 1. the free-space check of a save
def _on_disk(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _save_with_free(rank, world, d, cases):
    """Each case ``(name, shared, delta)``: a save with ``disk_free`` = the whole checkpoint's estimate + ``delta``.
    ``shared``: both ranks hold the same 1 MiB tensor under one key (data parallelism: DCP writes it once), and the
    save is given this rank's share of it; else each rank's own tensor (two replicas), the default share."""
    import dilocox.checkpoint.save as S
    from dilocox import checkpoint as ck

    out, real = {}, S.disk_free
    try:
        for step, (name, shared, delta) in enumerate(cases, 1):
            own = f"rank{rank}/rest"
            key = "replica0/model/w" if shared else f"replica{rank}/model/w"
            state = {key: torch.full((1 << 18,), 1.0), own: torch.full((64,), float(rank))}
            share = ck.estimate_bytes(state, None, world, [own]) if shared else ck.estimate_bytes(state)
            free = world * share + delta
            S.disk_free = lambda path, free=free: free
            kw = {"share": share} if shared else {}
            try:
                path = ck.save_checkpoint(f"{d}/{name}", step, rank, world, state, agree=ck.all_ranks_agree, **kw)
                out[name] = ("saved", world * share, _on_disk(path))
            except ck.CheckpointError as e:
                out[name] = ("refused", str(e), os.path.exists(os.path.join(d, name, ck.step_dir_name(step))))
    finally:
        S.disk_free = real
    return out


def test_a_save_needs_room_for_every_ranks_share_not_its_own_state(tmp_path):
    """Two ranks writing 1 MiB each (two replicas, no key shared): the checkpoint is 2 MiB, and a save with room for
    one rank's state only was let through (each rank compared its own state with the free space), to fail in DCP's
    writes. Now it is refused on both ranks before anything is created, at one byte below preflight's estimate
    (world_size shares), and goes ahead with exactly that much room (what it writes fits in it)."""
    cases = [("below", False, -1), ("at", False, 0)]
    res = run_ranks(2, _save_with_free, str(tmp_path), cases, timeout=180)
    for r in res:
        what, msg, left = r["below"]
        assert what == "refused", r["below"]
        assert "no space left on device" in msg and "2 ranks' shares" in msg and not left, msg
        what, need, disk = r["at"]
        assert what == "saved" and disk <= need, r["at"]
    assert res[0]["at"] == res[1]["at"]


def test_a_data_parallel_save_counts_its_shared_keys_once(tmp_path):
    """Both ranks hold the same 1 MiB key (D=2: DCP writes it once): with its share given, the save's need is one
    copy plus each rank's own part, a little above what is written (a default share would take two copies)."""
    cases = [("below", True, -1), ("at", True, 0)]
    res = run_ranks(2, _save_with_free, str(tmp_path), cases, timeout=180)
    for r in res:
        assert r["below"][0] == "refused" and "no space left on device" in r["below"][1], r["below"]
        what, need, disk = r["at"]
        assert what == "saved" and disk <= need <= 1.2 * disk, r["at"]


def _trainer_save_with_free(rank, world, tmp, extra):
    """A Trainer's save with ``disk_free`` one byte below, then at, the checkpoint its ranks' shares add up to."""
    import dilocox.checkpoint.save as S
    from dilocox import checkpoint as ck
    from dilocox.train import Trainer
    from tests.test_reshard import _cfg

    t = Trainer(_cfg(f"{tmp}/run", *extra, resume="none"))
    t.train_step()
    # (after a step the optimizer holds its moments: the share preflight took, and what is written)
    need = world * -ck.all_ranks_min(-t._checkpoint_share())  # the largest share decides
    real, out = S.disk_free, []
    try:
        S.disk_free = lambda path: need - 1
        try:
            t.save()
            out.append("saved")
        except ck.CheckpointError as e:
            out.append(str(e))
        S.disk_free = lambda path: need
        path = t.save()
    finally:
        S.disk_free = real
    return out[0], need, _on_disk(path)


@pytest.mark.parametrize(
    "extra",
    [["--parallel.data=2"], ["--parallel.replicas=2", "--outer.method=diloco", "--outer.sync_every=2"]],
    ids=["D2", "R2"],
)
def test_trainer_save_checks_room_for_the_checkpoint_preflight_estimates(tmp_path, extra):
    """The Trainer's save checks the free space against its ranks' shares (``_checkpoint_share``, preflight's):
    refused (every rank) one byte below them, saved at them, and the checkpoint written fits. Before, each rank
    checked its whole state: with two replicas half the checkpoint, so the save went ahead one byte below."""
    res = run_ranks(2, _trainer_save_with_free, str(tmp_path), extra, timeout=240)
    for refused, need, disk in res:
        assert "no space left on device" in refused and "2 ranks' shares" in refused, refused
        assert disk <= need <= 1.2 * disk, (need, disk)


# ------------------------------------------------------------------------------- 2. QuorumGroup's bytes
class _Counting:
    """A wire that adds to ``sent`` the bytes one member puts on it (compress/collectives.py's convention)."""

    def __init__(self, real, sent: list) -> None:
        self.real, self.sent = real, sent

    def size(self):
        return self.real.size()

    def rank(self):
        return self.real.rank()

    def all_reduce(self, t, op="sum"):
        w = self.size()
        self.sent[0] += -(-2 * (w - 1) * t.numel() * t.element_size() // w)
        self.real.all_reduce(t, op)

    def all_gather(self, out, t):
        self.sent[0] += (self.size() - 1) * t.numel() * t.element_size()
        self.real.all_gather(out, t)

    def all_to_all_single(self, out, t):
        self.sent[0] += (self.size() - 1) * t.numel() * t.element_size() // self.size()
        self.real.all_to_all_single(out, t)


def _calls(g, rank: int, sent: list) -> dict:
    """Every path of ``allreduce_mean`` (plain, int8 codec; norm_check; proposals): (counted, received, sent)."""
    from dilocox.compress.collectives import CommStats
    from dilocox.compress.compressor import build_compressor
    from dilocox.config import CompressConfig

    out = {}
    shapes = [torch.Size([64, 32]), torch.Size([100])]
    ts = [torch.randn(s, generator=torch.Generator().manual_seed(rank)) for s in shapes]
    for step, (quant, norm_check, propose) in enumerate(
        (q, c, p) for q in (None, "int8") for c in (0.0, 3.0) for p in (None, 5)
    ):
        g.norm_check, g.stats, sent[0] = norm_check, CommStats(), 0
        codec = None if quant is None else build_compressor(CompressConfig(quant=quant), shapes, 0)
        g.allreduce_mean(ts, step, codec, propose)
        out[(quant, norm_check, propose)] = (g.stats.bytes_sent, g.stats.bytes_received, sent[0])
        assert propose is None or g.agreed == propose
    return out


def _check(res: list[dict]) -> None:
    for rank_res in res:
        for case, (counted, received, sent) in rank_res.items():
            assert counted == received == sent, (case, counted, sent)
        # the int8 codec's own bytes + the count: fp32 [proposals (2) | norms (2, norm_check) | one-hot (2) | seen]
        assert rank_res[("int8", 0.0, None)][2] - rank_res[("int8", 0.0, 5)][2] == 0
        assert rank_res[("int8", 3.0, None)][2] - rank_res[("int8", 0.0, None)][2] == 4 * 2


def _fake_quorum_rank(rank: int, world: int) -> dict:
    """A ``QuorumGroup`` over gloo ranks through the fake of tests/test_outer_group.py, its count buffer laid out as
    ``ElasticOuterGroup.flat_sum``'s (with the lighthouse-seen slot)."""
    from dilocox.elastic.quorum import QuorumGroup
    from tests.test_outer_group import _FakeElastic

    sent = [0]

    class Fake(_FakeElastic):
        def flat_sum(self, flat, contribute):
            mr = self.cfg.max_replicas
            buf = torch.zeros(flat.numel() + mr + 1)
            if contribute:
                buf[: flat.numel()].copy_(flat)
                buf[flat.numel() + self.cfg.replica_rank] = 1
            self.group.all_reduce(buf)  # (counted: the wire below)
            return buf[: flat.numel()], buf[flat.numel() : flat.numel() + mr]

    el = Fake(rank, world)
    el.cfg.max_replicas = 2
    el.group = _Counting(el.group, sent)
    return _calls(QuorumGroup(el), rank, sent)


def test_quorum_group_counts_the_count_beside_a_codec():
    """Every byte a QuorumGroup sends is in its CommStats, by FixedGroup's convention: through a lossy codec the
    count all-reduce (one-hot, proposals, norms) was not counted, only the codec's own collectives."""
    _check(run_ranks(2, _fake_quorum_rank, timeout=120))


def _torchft_quorum_rank(rank: int, world: int, lighthouse: str) -> dict:
    from dilocox.elastic import ElasticOuterGroup
    from dilocox.elastic.group import ElasticConfig
    from dilocox.elastic.quorum import QuorumGroup

    cfg = ElasticConfig(lighthouse_addr=lighthouse, replica_rank=rank, min_replicas=2, max_replicas=2,
                        timeout_s=20.0, quorum_timeout_s=60.0)  # fmt: skip
    el, sent = ElasticOuterGroup(cfg), [0]
    try:
        el.group = _Counting(el.group, sent)  # the codec's collectives
        m, real = el._manager, el._manager.allreduce

        def allreduce(t, **kw):  # the count's and the plain path's buffer (flat_sum)
            w = el.group.size()
            sent[0] += -(-2 * (w - 1) * t.numel() * t.element_size() // w)
            return real(t, **kw)

        m.allreduce = allreduce
        return _calls(QuorumGroup(el), rank, sent)
    finally:
        el.close()


def test_torchft_quorum_group_counts_what_it_sends(tmp_path):
    """The same on a real torchft quorum of two replicas (its manager's all-reduce and its process group's wire
    counted as they are called)."""
    pytest.importorskip("torchft", reason="torchft==0.2.0 is not installed")
    from dilocox.elastic import start_lighthouse

    lh = start_lighthouse(2, heartbeat_timeout_ms=3000, join_timeout_ms=20000)
    try:
        _check(run_ranks(2, _torchft_quorum_rank, lh.address(), timeout=240, fresh=True))
    finally:
        lh.shutdown()
