"""The outer sync sharded over the inner data-parallel ranks of a replica (``outer.shard_over_data``):
the same model bit for bit as the unsharded sync, each DP rank sending 1/D of the bytes."""

from __future__ import annotations

import pytest
import torch

from tests.small_run import small_cfg
from tests.spawn import run_ranks


def _dp_sharded(rank, world, tmp, cases):
    from dilocox.train import Trainer

    out = {}
    for name, extra in cases.items():
        cfg = small_cfg(
            f"{tmp}/{name}",
            "--parallel.replicas=2",
            "--parallel.data=2",
            "--parallel.microbatches=1",
            "--outer.method=diloco",
            "--outer.sync_every=3",
            *extra,
            steps=9,
        )
        tr = Trainer(cfg)
        tr.run()
        out[name] = {
            "params": {n: p.detach().clone() for n, p in tr.model.named_parameters()},
            "bytes": tr.outer.stats["bytes_sent"],
            "coord": tr.topo.coord,
        }
    return out


@pytest.mark.slow  # ~15 s: five 4-rank training runs
def test_outer_sync_sharded_over_inner_dp_equals_unsharded_at_1_over_d_bytes(tmp_path):
    comp = [
        "--compress.quant=int4",
        "--compress.lowrank.enabled=true",
        "--compress.lowrank.rank=2",
        "--compress.group_size=32",
    ]
    cases = {
        "sharded": ["--outer.overlap=delayed", *comp],
        "unsharded": ["--outer.overlap=delayed", "--outer.shard_over_data=false", *comp],
        "eager_sharded": ["--outer.overlap=eager", "--outer.lr=0.5", "--outer.momentum=0.5"],
        "eager_unsharded": [
            "--outer.overlap=eager",
            "--outer.lr=0.5",
            "--outer.momentum=0.5",
            "--outer.shard_over_data=false",
        ],
        # adaptive: each DP rank's controller sees only its own tensors' spectra (ranks may differ per
        # DP rank), H is agreed by all; the global model must still be one model on all 4 ranks
        "adaptive_sharded": [
            "--outer.overlap=delayed",
            *comp,
            "--compress.adaptive.enabled=true",
            "--compress.adaptive.h_min=2",
            "--compress.adaptive.h_max=4",
            "--compress.adaptive.rank_min=1",
            "--compress.adaptive.rank_max=4",
        ],
    }
    res = run_ranks(4, _dp_sharded, str(tmp_path), cases)  # rank = replica * 2 + dp
    for a, b in (("sharded", "unsharded"), ("eager_sharded", "eager_unsharded")):
        for r in res:
            for n, v in r[a]["params"].items():
                assert torch.equal(v, r[b]["params"][n]), (a, n, r[a]["coord"])  # same math, bit for bit
        for r in res[1:]:  # and the DP ranks of a replica hold the same model
            for n, v in r[a]["params"].items():
                if r[a]["coord"].replica == 0:
                    assert torch.equal(v, res[0][a]["params"][n]), (a, n)
        sent_sharded = sum(r[a]["bytes"] for r in res)
        sent_unsharded = sum(r[b]["bytes"] for r in res)
        assert sent_unsharded > 0 and sent_sharded * 2 == sent_unsharded, (a, sent_sharded, sent_unsharded)
        assert all(0 < r[a]["bytes"] < r[b]["bytes"] for r in res)  # each DP rank sends a real share
    for r in res[1:]:
        for n, v in r["adaptive_sharded"]["params"].items():
            assert torch.equal(v, res[0]["adaptive_sharded"]["params"][n]), n
