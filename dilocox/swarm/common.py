"""What every part of a SWARM job shares: peer names and store keys, the error a peer stops with, the routers'
factory. (The inner step, its learning-rate schedule included, is ``dilocox train``'s: ``dilocox.inner_step``.)"""

from __future__ import annotations

from dilocox.swarm.routing import RandomRouter, build_router

DIGEST_ENV = "DILOCOX_SWARM_DIGESTS"  # set (tests): every sync record carries a hash of the params + AdamW state


class SwarmError(RuntimeError):
    """A SWARM peer cannot go on (a bounded wait ran out, or a stage lost every peer)."""


def peer_name(stage: int, index: int) -> str:
    return f"s{stage}p{index}"


def check_place(pps: list[int], stage: int, index: int, join: bool = False) -> None:
    """Refuse a peer outside the layout. A joiner moved here by rebalancing gets a new index in its stage: below the
    job's peer count (torchft ranks)."""
    if not 0 <= stage < len(pps) or not 0 <= index < (sum(pps) if join else pps[stage]):
        raise SwarmError(f"peer (stage={stage}, index={index}) is outside swarm.peers_per_stage={list(pps)}")


def check_lighthouse(cfg, stage: int, lighthouse: str | None) -> None:
    """A peer whose stage syncs over a torchft group (more than one peer, or rebalancing on) needs that stage's
    lighthouse: refused before it publishes its address (it failed only after waiting for every other peer)."""
    s = cfg.swarm
    if not lighthouse and (s.peers_per_stage[stage] > 1 or s.rebalance_period_s > 0):
        why = f"its {s.peers_per_stage[stage]} peers sync through it"
        if s.rebalance_period_s > 0:
            why = "swarm.rebalance_period_s > 0: every stage syncs through one, a peer may move in"
        raise SwarmError(
            f"stage {stage} needs its torchft lighthouse ({why}); pass --lighthouse http://HOST:PORT (the stage's "
            "`dilocox lighthouse`; `dilocox swarm` starts one for each such stage)"
        )


def validate_layout(cfg) -> None:
    """``config.validate_swarm_layout``, and: every stage holds model.n_layers / stages layers (``build_stage_model``),
    so a stage count that does not divide the layer count is a config error naming both (it was a traceback in every
    peer once they had all started)."""
    from dilocox.config import ConfigError, validate_swarm_layout

    validate_swarm_layout(cfg)
    pps, layers = list(cfg.swarm.peers_per_stage), cfg.model.n_layers
    if layers % len(pps):
        raise ConfigError(
            f"swarm.peers_per_stage={pps} has {len(pps)} stages, which do not divide model.n_layers={layers}: every "
            "stage holds the same number of layers; use a stage count that divides it"
        )
    check_stage_streaming(cfg)


def check_stage_streaming(cfg) -> None:
    """DiLoCo-SWARM streams its stage sync (``outer.streaming``: ``_build_outer`` passes it to ``build_outer``), so:
    every fragment needs a layer of the stage (not of ``parallel.pipeline``'s stage, which the config load checks: a
    peer died with a traceback in ``assign_fragments``), and rebalancing cannot move a peer without dropping local
    steps. A peer leaves after the outer step of fragment 0 (``(k + 1) % H == 0``); with K > 1 fragments the others
    synced last H/K.. H - H/K steps before, and with tau > 0 the last tau steps reach no all-reduce: no step boundary
    has every fragment's local steps in the stage's outer step, so they would be thrown away."""
    from dilocox.config import ConfigError

    s, st = cfg.swarm, cfg.outer.streaming
    if s.sync != "diloco":
        return
    per_stage = cfg.model.n_layers // len(s.peers_per_stage)
    if st.fragments > per_stage:
        raise ConfigError(
            f"outer.streaming.fragments={st.fragments} exceeds the {per_stage} layers of a stage "
            f"(model.n_layers={cfg.model.n_layers} over swarm.peers_per_stage={list(s.peers_per_stage)}): every "
            f"fragment of DiLoCo-SWARM's stage sync needs a layer of its stage; use at most {per_stage} fragments"
        )
    if s.rebalance_period_s > 0 and (st.fragments > 1 or st.tau > 0):
        raise ConfigError(
            f"swarm.rebalance_period_s={s.rebalance_period_s:g} with swarm.sync=diloco needs "
            f"outer.streaming.fragments=1 and outer.streaming.tau=0 (got fragments={st.fragments}, tau={st.tau}): "
            "a moving peer leaves after an outer step, and a streamed sync has none that carries every fragment's "
            "local steps, so some would be thrown away; set outer.streaming.fragments=1 and "
            "outer.streaming.tau=0, or swarm.rebalance_period_s=0"
        )


def parse_store(text: str, flag: str = "--store") -> tuple[str, int]:
    """``HOST:PORT`` of the job's address store -> (host, port); a one-line ``SwarmError`` naming ``flag`` else."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SwarmError(f"{flag} {text!r} must be HOST:PORT of the job's address store, PORT in 1..65535")
    return host, int(port)


def store_key(stage: int, index: int) -> str:
    return f"swarm/stage{stage}/peer{index}"


class FixedRouter(RandomRouter):
    """``swarm.routing=fixed``: a static pipeline: the sender with index k always sends to peer ``k mod m`` of the
    next stage (with one peer per stage: peer 0), or to the next live one in order when that one is banned."""

    offset = 0  # the sender's index within its stage

    def choose(self):
        live = set(self.live())
        if not live:
            raise self._no_live()
        order = list(self.until)  # every known peer, in insertion (index) order
        start = self.offset % len(order)
        return next(p for p in order[start:] + order[:start] if p in live)


def make_router(kind: str, peers: list[str], name: str, ban_s: float, seed: int, offset: int = 0):
    """The router of the sender with index ``offset`` in its stage (``seed``: the run's seed for that stage)."""
    if kind == "fixed":
        r = FixedRouter(peers, name=name, ban_s=ban_s)
        r.offset = offset
        return r
    # random: a stream of each sender's own (the senders of a stage seeded alike sent their i-th microbatches to the
    # same peer, every one of them: wiring as correlated as it gets, not the paper's independent uniform choices)
    return build_router(kind, peers, name=name, ban_s=ban_s, seed=seed * 1_000_003 + offset)


def split_peer_name(name: str) -> tuple[int, int]:
    """``s{stage}p{index}`` -> (stage, index)."""
    stage, sep, index = name[1:].partition("p")
    if not name.startswith("s") or not sep or not stage.isdigit() or not index.isdigit():
        raise ValueError(f"{name!r} is not a SWARM peer name s<stage>p<index> (e.g. s1p0)")
    return int(stage), int(index)


def largest_hop_bytes(cfg) -> int:
    """Bytes of the largest legitimate SWARM message of this run: one microbatch's fp32 activations (or their
    gradient) with its int64 tokens and targets."""
    mb, seq = cfg.swarm.microbatch_size, cfg.train.seq_len
    return mb * seq * cfg.model.d_model * 4 + 2 * mb * seq * 8


def rpc_security(cfg):
    """(secret or None, transport Limits, encrypt) of a SWARM peer: ``transport.use_secret(*rpc_security(cfg))``."""
    from dilocox.net.rpc import Limits
    from dilocox.net.secure import secret_for

    # connections a stage may legitimately hold at once: one per microbatch in flight from every upstream peer
    # (a forward waits downstream with its connection open), plus pings, markers and stats
    conns = max(64, 4 * sum(cfg.swarm.peers_per_stage) * cfg.swarm.max_inflight + 16)
    limits = Limits.for_run(largest_hop_bytes(cfg), max_connections=conns)
    secret = secret_for(cfg.security, "`dilocox swarm` writes one into its output directory")
    return secret, limits, bool(cfg.security.encrypt)
