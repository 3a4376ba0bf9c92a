"""Keys a combination silently ignored (dilocox/config/combos.py): each loaded, ran, and changed nothing (two runs
that differed only in the key ended with bit-identical parameters), so a run differed from its config with no word
said. Now each fails at load with one line naming the key, why and the fix; the combinations where the key acts
still load, and so does every preset and bench point built from them."""

from __future__ import annotations

import os

import pytest
import torch

from dilocox import cli
from dilocox.config import ConfigError, load_config, validate_swarm_layout
from dilocox.config.sections import CompressConfig, OuterConfig, StreamingConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
R2 = ["--parallel.replicas=2", "--outer.method=diloco", "--outer.sync_every=4"]
K2 = [*R2, "--outer.streaming.fragments=2"]

# (overrides, the key named, a word of the why): each loaded before and was a no-op (the runs' reproducers are in
# the review notes: bit-identical parameters after 6 steps)
NOOPS = [
    ([*K2, "--outer.streaming.merge=replay"], "outer.streaming.merge='replay'", "tau=0"),
    ([*R2, "--outer.streaming.merge=replay"], "outer.streaming.merge='replay'", "tau=0"),
    ([*K2, "--outer.overlap=delayed", "--outer.streaming.merge=replay"], "outer.streaming.merge", "overlap"),
    ([*K2, "--outer.overlap=delayed", "--outer.streaming.alpha=0.9"], "outer.streaming.alpha=0.9", "delayed"),
    ([*K2, "--outer.overlap=eager", "--outer.streaming.alpha=0.25"], "outer.streaming.alpha=0.25", "eager"),
    ([*R2, "--outer.streaming.alpha=0.9"], "outer.streaming.alpha=0.9", "fragments=1 and tau=0"),
    ([*R2, "--compress.collective=reduce_scatter"], "compress.collective='reduce_scatter'", "quant='none'"),
    ([*R2, "--compress.collective=allgather"], "compress.collective='allgather'", "quant='none'"),
    ([*R2, "--compress.collective=allgather", "--compress.lowrank.enabled=true"], "compress.collective", "ring"),
    (["--parallel.replicas=2", "--outer.method=allreduce", "--compress.collective=reduce_scatter"],
     "compress.collective", "quant='none'"),
    (["--outer.norm_check=4"], "outer.norm_check=4", "outer.method='none'"),
    (["--outer.lr_schedule=inner"], "outer.lr_schedule='inner'", "outer.method='none'"),
    ([*K2, "--train.device=cpu", "--outer.comm_stream=true"], "outer.comm_stream=True", "train.device='cpu'"),
    (["--train.steps=5", "--log.profile_start=10"], "log.profile_start=10", "train.steps=5"),
    (["--data.path=/tmp/corpus.txt"], "data.path='/tmp/corpus.txt'", "data.source='stdlib'"),
    (["--data.source=prose", "--data.path=corpus.txt"], "data.path", "data.source='prose'"),
    (["--data.source=docs", "--data.path=corpus.txt"], "data.path", "data.source='docs'"),
]  # fmt: skip


@pytest.mark.parametrize("overrides,key,why", NOOPS, ids=[" ".join(c[0][-2:]) for c in NOOPS])
def test_a_key_the_run_would_ignore_fails_at_load(overrides, key, why):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    msg = str(e.value)
    assert msg.startswith(key.split("=")[0]) and key in msg and why in msg, msg
    assert "; " in msg and " or " in msg, f"no fix named: {msg}"  # each message ends with what to set instead


def test_the_cli_says_it_in_one_line(capsys, tmp_path):
    argv = ["train", TINY, *R2, "--nproc", "2", f"--log.run_dir={tmp_path}", "--outer.streaming.alpha=0.9"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("config error: outer.streaming.alpha=0.9"), err
    assert not os.listdir(tmp_path)  # before any rank started


# the same keys where they act: these load as before
ACTS = [
    [*R2, "--outer.streaming.tau=1", "--outer.streaming.merge=replay"],  # dilocox-far's K = 1, tau 2, replay
    [*K2, "--outer.streaming.tau=1", "--outer.streaming.merge=replay"],
    [*K2, "--outer.streaming.alpha=0.9"],
    [*R2, "--outer.streaming.tau=1", "--outer.streaming.alpha=0.25"],
    [*K2, "--outer.overlap=delayed"],  # alpha at its default: not told apart from unset
    [*R2, "--compress.quant=int8", "--compress.collective=reduce_scatter"],
    [*R2, "--compress.quant=fp16", "--compress.collective=allgather"],
    [*R2, "--compress.sparse.enabled=true", "--compress.collective=reduce_scatter"],
    [*R2, "--compress.sign.enabled=true", "--compress.collective=allgather"],
    ["--parallel.replicas=2", "--outer.method=cocktailsgd", "--compress.collective=allgather"],
    ["--parallel.replicas=3", "--outer.method=diloco", "--outer.norm_check=4"],
    [*R2, "--outer.lr_schedule=inner"],
    ["--data.source=text", "--data.path=corpus.txt"],
    ["--data.source=hf", "--data.path=wikitext", "--data.hf_config=wikitext-2-raw-v1"],
    ["--data.source=memmap", "--data.path=prepared"],
    # inert parameters of a feature that is off are kept (a sweep flips the switch and leaves them): not refused
    [*R2, "--compress.lowrank.rank=8", "--compress.adaptive.h_min=25"],
    [*R2, "--outer.streaming.pattern=strided"],
    ["--optim.muon_momentum=0.5", "--optim.schedule=constant", "--optim.min_lr_ratio=0.5"],
    [*R2, "--compress.quant=fp16", "--compress.group_size=32", "--compress.error_feedback=false"],
    [*R2, "--outer.blocking=true"],
    # outer.method=none: no outer loop in `dilocox train`; the outer and compress keys are SWARM's (sync=diloco)
    ["--outer.streaming.alpha=0.25", "--compress.collective=reduce_scatter", "--outer.streaming.merge=replay"],
]


@pytest.mark.parametrize("overrides", ACTS, ids=[" ".join(a[-2:]) for a in ACTS])
def test_the_same_keys_load_where_they_act(overrides):
    load_config(TINY, overrides)


def test_every_preset_and_bench_point_still_loads():
    """What the benches build (bench methods' presets and ablation, bench frontier's points and levers, on each
    corpus) and every YAML under configs/: none of them hits a new refusal."""
    import glob
    import tempfile

    from dilocox.bench import frontier, methods
    from dilocox.bench.runner import write_config

    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True)):
        load_config(path, [])
    entries = [(preset, ov) for lst in (frontier.POINTS, frontier.LEVERS) for _, _, preset, ov in lst]
    entries += [(m, []) for m in methods.METHODS] + [(preset, ov) for _, preset, ov in methods.ABLATION]
    with tempfile.TemporaryDirectory() as tmp:
        for preset, ov in entries:
            p = "allreduce" if preset == "allreduce-tuned" else preset
            cfg = write_config(
                os.path.join(tmp, "c.yaml"), ["tiny.yaml", f"methods/{p}.yaml"], methods.method_body(p, 20)
            )
            for corpus in frontier.CORPORA.values():
                load_config(cfg, [corpus, *ov])


# SWARM (`dilocox swarm`): swarm.sync picks the stage sync, a DiLoCo outer step built with outer.method=diloco
# whatever the config says, whose outer lr never follows the inner schedule (swarm/peer.py _build_outer); with
# swarm.sync=diloco the streaming and compress rules of `dilocox train`'s DiLoCo apply to it (outer.method=none there)
@pytest.mark.parametrize(
    "overrides,key,why",
    [
        (["--outer.method=cocktailsgd", "--swarm.sync=diloco"], "outer.method='cocktailsgd'", "SWARM"),
        (["--outer.method=allreduce"], "outer.method='allreduce'", "SWARM"),
        (["--outer.method=diloco", "--outer.lr_schedule=inner", "--swarm.sync=diloco"], "outer.lr_schedule", "SWARM"),
        (["--swarm.sync=diloco", "--outer.streaming.alpha=0.9"], "outer.streaming.alpha=0.9", "fragments=1"),
        (["--swarm.sync=diloco", "--outer.streaming.merge=replay"], "outer.streaming.merge", "tau=0"),
        (["--swarm.sync=diloco", "--compress.collective=reduce_scatter"], "compress.collective", "quant='none'"),
    ],
)
def test_swarm_refuses_what_its_stage_sync_ignores(overrides, key, why):
    cfg = load_config(TINY, overrides)  # (a `dilocox train` of these runs no outer loop here, or its own method)
    with pytest.raises(ConfigError) as e:
        validate_swarm_layout(cfg)
    assert str(e.value).startswith(key) and why in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["--outer.method=none", "--swarm.sync=diloco", "--outer.lr=0.5", "--outer.streaming.fragments=2"],
        ["--outer.method=diloco", "--swarm.sync=diloco", "--compress.quant=int8", "--compress.collective=allgather"],
        ["--swarm.sync=swarm", "--outer.streaming.alpha=0.9"],  # the outer section waits for sync=diloco
    ],
)
def test_swarm_keeps_what_its_stage_sync_runs(overrides):
    validate_swarm_layout(load_config(TINY, overrides))


# the rule and the outer loop agree: a streaming mix (alpha) and replay act exactly where the config accepts them
@pytest.mark.parametrize(
    "K,tau,overlap",
    [(1, 0, "none"), (2, 0, "none"), (1, 1, "none"), (2, 1, "none"), (1, 0, "delayed"), (2, 0, "delayed"),
     (2, 0, "eager")],
)  # fmt: skip
def test_the_outer_loop_mixes_where_the_config_accepts_alpha_and_replay(K, tau, overlap):
    from dilocox.outer import build_outer

    def accepted(**s) -> bool:
        over = [*R2, f"--outer.streaming.fragments={K}", f"--outer.streaming.tau={tau}", f"--outer.overlap={overlap}"]
        try:
            load_config(TINY, over + [f"--outer.streaming.{k}={v}" for k, v in s.items()])
        except ConfigError:
            return False
        return True

    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(2)))
    params = list(model.named_parameters())
    for merge in ("mix", "replay"):
        s = StreamingConfig(fragments=K, tau=tau, alpha=0.9, merge=merge)
        o = OuterConfig(method="diloco", sync_every=4, overlap=overlap, streaming=s)
        try:
            outer = build_outer(params, None, o, CompressConfig(), 0, layer_of=lambda n: int(n.split(".")[0]))
        except ConfigError:  # (replay with overlap delayed/eager: the loop refuses it too)
            assert merge == "replay" and not accepted(merge="replay")
            continue
        try:
            assert (outer.alpha == 0.9) == accepted(alpha=0.9)
            if merge == "replay":
                assert outer.replay == accepted(merge="replay")
        finally:
            outer.close()
