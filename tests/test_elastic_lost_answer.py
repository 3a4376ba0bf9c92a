"""A quorum member that never configures (it lost the lighthouse's answer) costs the others a short, bounded wait,
not the whole ``elastic.timeout_s``.

torchft's lighthouse keeps a replica's quorum request in its participants after the replica's client gave up on it
(a request that timed out; torchft 0.2 ``src/lighthouse.rs`` clears participants only when a quorum forms). A quorum
formed just after that includes the replica, whose answer went nowhere: the others then waited in the process
group's rendezvous for a member that was not coming (the CI failure of test_peer_moves_into_stage0 on 2026-11-29:
a joiner's 2 s quorum attempt ran out as the stage's peer asked, the peer waited 60 s twice, the stage's
neighbour timed out). Here a "ghost" sends one quorum request and lets it time out; the replica's next outer step
includes it; the step must fail over to a new quorum within the publish window (``elastic.mesh.publish_window``)
on both process groups (gloo and the authenticated mesh)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

SECRET = b"g" * 32


@pytest.mark.parametrize("collectives", ["gloo", "authenticated"])
def test_a_member_that_lost_the_quorums_answer_costs_the_publish_window_not_the_timeout(collectives):
    pytest.importorskip("torchft", reason="torchft==0.2.0 is not installed (pip install torchft==0.2.0)")
    from torchft._torchft import LighthouseClient

    from dilocox.elastic import ElasticConfig, ElasticOuterGroup, start_lighthouse
    from dilocox.elastic.mesh import publish_window

    timeout_s = 40.0
    secret = SECRET if collectives == "authenticated" else None
    lh = start_lighthouse(1, bind="127.0.0.1:0", secret=secret, heartbeat_timeout_ms=2000)
    cfg = ElasticConfig(lighthouse_addr=lh.address(), replica_rank=0, min_replicas=1, max_replicas=2,
                        timeout_s=timeout_s, quorum_timeout_s=30, host="127.0.0.1", lighthouse_auth=secret is not None,
                        secret=secret, collectives=collectives)  # fmt: skip
    group = ElasticOuterGroup(cfg)
    try:
        x = torch.arange(4.0)
        first = group.allreduce_mean(x)
        assert first.contributors == [0] and first.attempts == 1
        # the ghost: one request (through the replica's own relay where the lighthouse is guarded) that times out;
        # the lighthouse keeps it as a participant, healthy for heartbeat_timeout_ms
        addr = group.relay.address if group.relay is not None else lh.address()
        ghost = LighthouseClient(addr, timedelta(seconds=5))
        with pytest.raises(Exception, match="(?i)timeout|deadline|cancel"):
            ghost.quorum("zghost", timedelta(seconds=0.3), address="http://127.0.0.1:1", store_address="",
                         step=first.step, world_size=1)  # fmt: skip
        t0 = time.monotonic()
        res = group.allreduce_mean(x)  # quorum 2 = {replica0, zghost}: zghost never configures
        took = time.monotonic() - t0
        assert res.contributors == [0] and torch.equal(res.mean, x)
        assert res.attempts == 2, "the ghost was not in the quorum: the test did not set the trap"
        window = publish_window(timeout_s)
        assert window < timeout_s / 2
        assert took < window + 8.0, f"{took:.1f}s: the replica waited for the ghost beyond the publish window"
    finally:
        group.close()
        lh.shutdown()
