"""Three accounting checks: checkpoint.preflight's size estimate with data parallelism (DCP writes the D copies of a
tensor once), FixedGroup's byte counts of its small side collectives (the H proposals' MAX, outer.norm_check's
all-gather), and a blocking launch's time in the step's ``blocked_s`` (streaming tau > 0)."""

from __future__ import annotations

import os

import pytest
import torch

from dilocox.config import CompressConfig, OuterConfig
from dilocox.config.sections import StreamingConfig
from tests.reference_diloco import forward_backward, layer_of, make_inner_opt, make_model
from tests.spawn import run_ranks


# ------------------------------------------------------------------------------------- 1. preflight with D > 1
def _estimate_and_save(rank, world, tmp, extra):
    from dilocox import checkpoint as ck
    from dilocox.train import Trainer
    from tests.test_reshard import _cfg

    real, seen = ck.preflight, {}

    def spy(ckpt_dir, shard_bytes, world_size, *a, **k):
        seen["one"] = shard_bytes * world_size  # what preflight takes one checkpoint for
        return real(ckpt_dir, shard_bytes, world_size, *a, **k)

    ck.preflight = spy
    try:
        t = Trainer(_cfg(f"{tmp}/run", *extra, resume="none"))
    finally:
        ck.preflight = real
    t.train_step()
    return seen["one"], t.save()


def _on_disk(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_preflight_estimates_a_data_parallel_checkpoint_as_written(tmp_path):
    """D=2: DCP writes the model and optimizer once for both DP ranks (2.11 MB here); preflight took the checkpoint
    for 2 full shards (3.76 MB, x1.78). Now its estimate is what is written, a little above (never below)."""
    res = run_ranks(2, _estimate_and_save, str(tmp_path), ["--parallel.data=2"], timeout=240)
    disk = _on_disk(res[0][1])
    for one, _ in res:
        assert disk <= one <= 1.2 * disk, (one, disk)


# ------------------------------------------------------------------------------------- 2. FixedGroup's bytes
def _counted_and_sent(rank, world):
    import torch.distributed as dist

    from dilocox.compress.collectives import CommStats
    from dilocox.compress.compressor import build_compressor
    from dilocox.outer.group import FixedGroup

    out = {}
    for quant in (None, "int8"):
        for norm_check, propose in ((0.0, None), (3.0, None), (0.0, 5), (3.0, 5)):
            g = FixedGroup(dist.group.WORLD, world, norm_check)
            real, sent = g.wire, [0]

            class Counting:  # the bytes one member puts on the wire, by compress/collectives.py's convention
                def size(self):
                    return real.size()

                def rank(self):
                    return real.rank()

                def all_reduce(self, t, op="sum"):
                    sent[0] += -(-2 * (world - 1) * t.numel() * t.element_size() // world)
                    real.all_reduce(t, op)

                def all_gather(self, out, t):
                    sent[0] += (world - 1) * t.numel() * t.element_size()
                    real.all_gather(out, t)

                def all_to_all_single(self, out, t):
                    sent[0] += (world - 1) * t.numel() * t.element_size() // world
                    real.all_to_all_single(out, t)

            g.wire, g.stats = Counting(), CommStats()
            shapes = [torch.Size([64, 32]), torch.Size([100])]
            ts = [torch.randn(s, generator=torch.Generator().manual_seed(rank)) for s in shapes]
            codec = None if quant is None else build_compressor(CompressConfig(quant=quant), shapes, 0)
            g.allreduce_mean(ts, 1, codec, propose)
            out[(quant, norm_check, propose)] = (g.stats.bytes_sent, g.stats.bytes_received, sent[0])
    return out


def test_fixed_group_counts_the_norm_gather_and_the_h_agreement():
    """Every byte FixedGroup sends is in its CommStats: the mean's (plain or the codec's), the MAX all-reduce of the
    H proposals (int64) and outer.norm_check's all-gather of the norms (float64); before, the last two were not."""
    for rank_res in run_ranks(2, _counted_and_sent):
        for case, (counted, received, sent) in rank_res.items():
            assert counted == received == sent, (case, counted, sent)
        for quant in (None, "int8"):
            base = rank_res[(quant, 0.0, None)][2]
            assert rank_res[(quant, 3.0, None)][2] == base + 8  # x 8 bytes, R = 2
            assert rank_res[(quant, 0.0, 5)][2] == base + 8  # ceil(2 x 8 / R)
            assert rank_res[(quant, 3.0, 5)][2] == base + 16


# ------------------------------------------------------------------------------------- 3. blocked_s at a launch
def test_blocking_launch_of_a_streaming_fragment_is_in_its_steps_blocked_s():
    """overlap none, blocking, tau=1: the all-reduce is waited for at its launch step, a step before its sync. That
    step's record (``stats``, copied into metrics.jsonl) showed blocked_s 0 at every step while blocked_total_s grew
    0.1 s per launch; now each step that did outer work reports its own block, and they add up to the total."""
    from dilocox.outer import build_outer

    model, delay = make_model(0), 0.05
    opt = make_inner_opt(model)
    ocfg = OuterConfig(
        method="diloco", sync_every=8, overlap="none", blocking=True, streaming=StreamingConfig(fragments=2, tau=1)
    )
    loop = build_outer(
        list(model.named_parameters()), None, ocfg, CompressConfig(quant="none"), seed=0, layer_of=layer_of,
        comm_delay_s=delay,
    )  # fmt: skip
    total, reported = 0.0, []
    try:
        for step in range(16):
            forward_backward(model, 0, 0, step)
            opt.step()
            opt.zero_grad()
            loop.after_inner_step(step)
            s = loop.stats
            grew, total = s["blocked_total_s"] - total, s["blocked_total_s"]
            if loop.crossed_replicas:
                reported.append(s["blocked_s"])
                assert s["blocked_s"] == pytest.approx(grew, abs=1e-9), (step, s)
    finally:
        loop.finish()
    assert total >= 4 * delay * 0.9  # four launches, each waited for
    assert sum(reported) == pytest.approx(total, abs=1e-9)
    assert sum(b >= delay * 0.9 for b in reported) == 4, reported  # the launch steps' blocks are reported
