"""``dilocox bench swarm``: its analysis on synthetic peer records, its report (parts a-d, parts carried over from an
earlier run), its argument checks, the static pipeline's wiring, the pacing of a peer (``--pace-s``)."""

from __future__ import annotations

import os
import time

import pytest

from dilocox.bench import swarm as bs
from dilocox.bench.runner import CONFIGS
from dilocox.swarm.cli import SwarmUsageError, run_main
from dilocox.swarm.faults import Faults
from dilocox.swarm.peer import make_router


def _recs():
    """2 x 2, 4 steps: stage-0 peers log their step times and links, stage-1 peers their microbatches."""
    link = {"s1p0": [100, 80], "s1p1": [50, 40]}
    s0 = [{"step": k, "seconds": 2.0 if k == 0 else 1.0, "loss": 5 - k, "link_bytes": link} for k in range(4)]
    return {
        "s0p0": s0,
        "s0p1": [dict(r) for r in s0],
        "s1p0": [{"step": k, "microbatches": 3, "seconds": 1.0} for k in range(4)],
        "s1p1": [{"step": k, "microbatches": 1, "seconds": 1.0} for k in range(4)],
    }


def test_bytes_syncs_throughput_and_share_from_records():
    r = _recs()
    assert bs.pipeline_bytes(r) == 2 * 4 * (180 + 90)
    assert bs.stage_sync_count(r, "swarm", 10, 4) == 4
    assert bs.stage_sync_count(r, "diloco", 2, 4) == 2  # no outer markers: steps / H
    r["s1p0"][1]["outer"] = r["s1p0"][3]["outer"] = True
    assert bs.stage_sync_count(r, "diloco", 1, 4) == 2  # counted from the records when they say so
    secs = bs.step_seconds(r)
    assert secs == [2.0, 1.0, 1.0, 1.0]
    assert bs.tokens_per_s(secs, 100) == pytest.approx(400 / 5)
    assert bs.tokens_per_s(secs, 100, 1) == pytest.approx(100.0)  # the first (start-up) step skipped
    assert bs.tokens_per_s([], 100) is None
    assert bs.served_per_step(r, 1) == {0: 4, 1: 4, 2: 4, 3: 4}
    assert bs.share(r, "s1p1", 1) == pytest.approx(0.25)
    assert bs.share(r, "s9p9", 1) == 0.0
    for k in range(4):  # s1p0 works 0.3 s per microbatch, s1p1 0.9 s: throughputs 3 : 1 -> s1p1 predicted 1/4
        r["s1p0"][k]["busy_s"], r["s1p1"][k]["busy_s"] = 0.9, 0.9
    assert bs.predicted_share(r, "s1p1", 1) == pytest.approx(0.25)
    assert bs.predicted_share(r, "s1p0", 1) == pytest.approx(0.75)
    assert bs.predicted_share(r, "s0p0", 1) is None


def test_kill_analysis_windows_and_reroute_time():
    secs = [3.0, 1.0, 1.0, 1.0, 4.0, 2.0, 2.0, 2.0, 2.0]
    r = {"s0p0": [{"step": k, "seconds": s} for k, s in enumerate(secs)]}
    bans = [{"peer": "s1p1", "t": 105.5}, {"peer": "s1p1", "t": 104.25}]
    c = bs.kill_analysis(r, bans, kill_t=104.0, kill_step=3, tokens_per_step=10)
    assert c["tokens_s_before"] == pytest.approx(10.0)  # steps 1, 2
    assert c["tokens_s_during"] == pytest.approx(20 / 5.0)  # steps 3, 4
    assert c["tokens_s_after"] == pytest.approx(5.0)  # steps 5..8
    assert c["kill_to_reroute_s"] == pytest.approx(0.25) and c["bans"] == 2
    assert bs.kill_analysis(r, [], 104.0, 3, 10)["kill_to_reroute_s"] is None


def test_markdown_reports_every_part(tmp_path):
    run = {"peers": [4, 4], "sync": "swarm", "val_loss": 3.0, "train_loss_last": 3.1, "losses": [5, 4, 3],
           "tokens": 100, "stage_syncs": 30, "pipeline_bytes": 10e6, "pipeline_bytes_planned": 10e6,
           "sync_bytes": 30e6, "tokens_s": 500.0}  # fmt: skip
    dl = dict(run, sync="diloco", val_loss=3.03, stage_syncs=3, sync_bytes=3e6)
    base = dict(run, peers=[1, 1], val_loss=3.5, stage_syncs=30, sync_bytes=0, pipeline_bytes=2.5e6)
    rows = (("iwrr", 150, 0.33), ("random", 100, 0.5), ("fixed", 100, 0.5))
    b = {k: {"tokens_s": t, "slow_share": s, "busy_s_per_mb": [0.2, 0.41], "busy_ratio": 2.05} for k, t, s in rows}
    for r in b.values():
        r["vs_static"] = r["tokens_s"] / 100
        r["of_bound"] = r["vs_static"] / 1.5
    c = {"steps": 9, "kill_step": 3, "tokens_s_before": 10.0, "tokens_s_during": 4.0, "tokens_s_after": 5.0,
         "kill_to_reroute_s": 0.25, "steps_with_all_microbatches": 9, "expected_per_step": 8,
         "served_per_step": [8] * 9}  # fmt: skip
    d = {bs.diloco_label(H): dict(dl, H=H, val_loss=v, stage_syncs=30 // H) for H, v in ((10, 3.03), (5, 3.02))}
    res = {"date": "d", "machine": "m", "load_before": "9.0 8.0 7.0", "load_after": "1 2 3", "command": "dilocox x",
           "steps": 30, "H": 10, "hetero_steps": 12, "pace": 0.2, "hetero_mb": 12,
           "plot": "docs/bench/swarm/swarm.png", "b": b, "c": c, "d": d,
           "a": {"baseline 1x2": base, "SWARM 4x2": run, "DiLoCo-SWARM 4x2 H=10": dl}}  # fmt: skip
    md = bs.markdown(res)
    assert "load average before the runs 9.0 8.0 7.0" in md and "`dilocox x`" in md
    assert "| SWARM 4x2 | 4+4 | 100 | 3.0000 |" in md
    assert "final val loss +1.0 % with 10x fewer stage syncs and 10x fewer sync bytes" in md
    assert "DiLoCo-SWARM H=10 instead of the paper's 50" in md
    assert "paced at 0.2 s and 0.4 s per microbatch" in md and "24 microbatches per step" in md
    assert "| IWRR | 150 | 1.50x | 100% | 0.33 | - | 0.200, 0.410 (2.05) |" in md
    assert "| static pipeline (pairs fixed) | 100 | 1.00x | 67% | 0.50 | - |" in md
    assert "**(d) H ablation** (DiLoCo-SWARM 4x2, 30 steps each" in md
    assert md.index("| 5 | 6 | 3.0200 | +0.7 % |") < md.index("| 10 | 3 | 3.0300 | +1.0 % |")  # sorted by H
    assert "Final val loss rises monotonically with H here." in md
    d[bs.diloco_label(10)]["val_loss"] = 3.01
    assert "Final val loss does not rise monotonically with H here." in bs.markdown(res)
    assert "kill -> first re-routed microbatch 0.25 s; 9/9 steps had all 8 microbatches" in md
    path = bs.plot(res, str(tmp_path / "swarm.png"))
    assert os.path.getsize(path) > 1000


def test_carry_over_keeps_the_parts_not_run_with_their_own_run_details():
    """``--parts c`` after a full run: (a), (b), (d) stay in the report, with the date/command/steps that measured
    them; a part run now replaces the earlier one."""
    old = {"date": "OLD", "load_before": "1", "load_after": "2", "command": "dilocox bench swarm --steps 400",
           "machine": "m", "steps": 400, "H": 50, "hetero_steps": 12, "pace": 0.2, "hetero_mb": 12,
           "a": {"x": 1}, "b": {"y": 2}, "c": {"old": True}, "d": {"z": 3}}  # fmt: skip
    new = {"date": "NEW", "command": "dilocox bench swarm --parts c", "steps": 30, "H": 10, "c": {"new": True}}
    res = bs.carry_over(new, old, {"c"})
    assert res["c"] == {"new": True} and res["a"] == {"x": 1} and res["b"] == {"y": 2} and res["d"] == {"z": 3}
    assert set(res["earlier"]) == {"a", "b", "d"} and res["earlier"]["a"]["date"] == "OLD"
    assert bs._params(res, "a")["steps"] == 400 and bs._params(res, "c")["steps"] == 30
    again = bs.carry_over({"date": "NEWER", "c": {}}, res, {"c"})  # the earlier details survive a second re-run
    assert again["earlier"]["a"]["date"] == "OLD" and again["earlier"]["a"]["command"].endswith("--steps 400")


def test_markdown_names_the_earlier_run_of_carried_parts():
    c = {"steps": 9, "kill_step": 3, "tokens_s_before": 10.0, "tokens_s_during": 4.0, "tokens_s_after": 5.0,
         "kill_to_reroute_s": 0.25, "steps_with_all_microbatches": 9, "expected_per_step": 8,
         "served_per_step": [8] * 9}  # fmt: skip
    res = {"date": "NEW", "machine": "m", "load_before": "1", "load_after": "2", "command": "dilocox bench swarm -x",
           "c": dict(c, steps=12), "earlier": {"c": {"date": "OLD", "load_before": "3", "load_after": "4",
                                                     "command": "dilocox y"}}}  # fmt: skip
    md = bs.markdown(res)
    assert "(c) from an earlier run: measured OLD, load average before 3, after 4; command `dilocox y`." in md


def test_part_d_reuses_the_run_of_part_a_at_the_same_H(monkeypatch):
    calls = []
    monkeypatch.setattr(bs, "_run_a", lambda root, label, peers, extra, steps, H, t: calls.append(H) or {"H": H})
    a = {bs.diloco_label(50): {"H": 50, "val_loss": 3.0}, "SWARM 4x2": {"H": 1}}
    d = bs.part_d("/tmp/x", 400, [10, 50, 200], 60.0, a)
    assert calls == [10, 200] and d[bs.diloco_label(50)]["reused"] and d[bs.diloco_label(50)]["val_loss"] == 3.0
    assert list(d) == [bs.diloco_label(H) for H in (10, 50, 200)]
    calls.clear()
    bs.part_d("/tmp/x", 400, [50], 60.0, None)
    assert calls == [50]  # nothing to reuse: run it


def test_busy_per_microbatch_and_smoothed_curve():
    r = {"s1p1": [{"step": 0, "microbatches": 2, "busy_s": 9.0}, {"step": 1, "microbatches": 4, "busy_s": 1.6},
                  {"step": 2, "microbatches": 6, "busy_s": 2.4}]}  # fmt: skip
    assert bs.busy_per_mb(r, "s1p1") == pytest.approx(0.4)  # step 0 (start-up) skipped
    assert bs.busy_per_mb(r, "s9p9") is None
    xs, ys = bs.smooth(list(range(100)), points=10)
    assert len(xs) == 10 and xs[0] == 4.5 and ys[0] == 4.5 and ys[-1] == 94.5
    assert bs.smooth([1.0, 2.0], points=40) == ([0.0, 1.0], [1.0, 2.0])


def test_pace_occupies_the_peer_for_the_rest_of_its_pace():
    """--pace-s T: a microbatch whose compute took c < T seconds sleeps T - c more; one slower than T sleeps not."""
    faults = Faults(pace_s=0.3)
    t = time.monotonic()
    faults.pace(0.1)
    assert 0.19 <= time.monotonic() - t < 0.4
    t = time.monotonic()
    faults.pace(0.5)
    Faults().pace(0.0)
    assert time.monotonic() - t < 0.05


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--pace", "s5p0=1"], "--pace s5p0: no such peer in swarm.peers_per_stage"),
        (["--pace", "s1p0=slow"], "--pace 's1p0=slow' must be PEER=SECONDS"),
        (["--pace", "s1p0=-1"], "SECONDS >= 0"),
    ],
)
def test_swarm_cli_rejects_bad_pace(argv, msg, tmp_path):
    with pytest.raises(SwarmUsageError, match=msg):
        run_main([os.path.join(CONFIGS, "tiny.yaml"), "--peers", "2,2", *argv, "--out", str(tmp_path)])


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--steps", "25", "--H", "10"], "must be a positive multiple of --H"),
        (["--parts", "a,x"], "letters among a, b, c, d"),
        (["--pace", "0"], "--pace 0.0 must be > 0"),
        (["--hetero-steps", "2"], "at least 4"),
        (["--hetero-mb", "1"], "--hetero-mb 1 must be at least 2"),
        (["--ablation-H", "10,x"], "must be comma-separated integers"),
        (["--steps", "400", "--ablation-H", "10,30"], "--steps 400 must be a positive multiple of --ablation-H 30"),
    ],
)
def test_bench_swarm_rejects_bad_arguments(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        bs.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_static_pipeline_wires_peer_k_to_peer_k():
    """swarm.routing=fixed is the static pipeline of (b): s0p0 -> s1p0, s0p1 -> s1p1 (a banned one: the next)."""
    down = ["s1p0", "s1p1"]
    r0 = make_router("fixed", down, "stage 1", 5.0, seed=0, offset=0)
    r1 = make_router("fixed", down, "stage 1", 5.0, seed=0, offset=1)
    assert {r0.choose() for _ in range(5)} == {"s1p0"}
    assert {r1.choose() for _ in range(5)} == {"s1p1"}
    r1.failed("s1p1")
    assert r1.choose() == "s1p0"
    r3 = make_router("fixed", ["s1p0"], "stage 1", 5.0, seed=0, offset=3)
    assert r3.choose() == "s1p0"  # one peer per stage: everyone sends there


# IWRR share of a 3x slower peer on real processes: `dilocox bench swarm` part (b); deterministic: test_swarm_routing.py


def test_part_e_gap_and_reduction_are_against_fp32_of_the_same_corpus_and_sync():
    from dilocox.bench import swarm_act as sa

    def row(point, act_bytes, val, corpus="code"):
        return dict(corpus=corpus, sync="swarm", point=point, act_bytes=act_bytes, tokens=100, val_loss=val,
                    values_per_token=64, counted_equals_planned=True)  # fmt: skip

    rows = [row("fp32", 51200, 2.0), row("subspace-int4 k=4", 425, 2.03), row("fp32", 51200, 3.0, "prose"),
            row("subspace-int4 k=4", 425, 3.3, "prose"), row("int8", 12812, 2.0)]  # fmt: skip
    sa.analyse(rows)
    assert rows[1]["reduction"] == pytest.approx(51200 / 425) and rows[1]["gap"] == pytest.approx(0.015)
    assert rows[3]["gap"] == pytest.approx(0.1) and rows[0]["gap"] == 0.0
    md = sa.markdown({"rows": rows, "date": "d", "machine": "m", "command": "c", "steps": 4, "H": 2})
    assert "code, swarm: best point at >= 100x: subspace-int4 k=4 (120x, gap +1.50%): meets" in md
    assert "prose, swarm: best point at >= 100x: subspace-int4 k=4 (120x, gap +10.00%): misses" in md
    assert sa.act_bytes_per_token(rows[1]) == 4.25


def test_bench_swarm_parts_e_goes_to_its_own_driver(tmp_path):
    """`dilocox bench swarm --parts e` runs dilocox.bench.swarm_act (here: --render of a results.json)."""
    import json

    from dilocox.cli import main as cli_main

    rows = [dict(corpus="code", sync="swarm", point=p, act_bytes=b, tokens=10, val_loss=v, values_per_token=64,
                 counted_equals_planned=True) for p, b, v in (("fp32", 5120, 2.0), ("int8", 1281, 2.01))]  # fmt: skip
    res = {"rows": rows, "date": "d", "machine": "m", "command": "c", "steps": 4, "H": 2}
    (tmp_path / "results.json").write_text(json.dumps(res))
    assert cli_main(["bench", "swarm", "--parts=e", "--render", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "results.md").read_text()
    assert "| code | swarm | int8 | 64 | 128.10 | 4.0x | 2.0100 | +0.50% | yes |" in md
    with pytest.raises(SystemExit):  # part e is not a letter of the a-d driver
        bs.main(["--parts", "a,e"])
