"""``dilocox bench churn`` (issue 45): the kill schedule and the analysis (goodput, rejoin per event, θ compared at
every outer step) on synthetic records whose every number is worked out by hand."""

from __future__ import annotations

import os

import pytest

from dilocox.bench.churn import analyze, digest_mismatches, incarnations, kill_schedule, markdown, useful


def _rec(step: int, wall: float, digest: str | None = None) -> dict:
    o = (step + 1) // 5  # H = 5: the record of step 4 is the first with outer_step 1
    return {"step": step, "wall": wall, "loss": 1.0, "outer_step": o, "theta_digest": digest or f"d{o}"}


def _run() -> dict:
    r0 = [_rec(k, 100.0 + k) for k in range(20)]
    first = [_rec(k, 100.0 + k) for k in range(8)]  # killed after step 7: steps 5-7 never reach an outer step
    second = [_rec(k, 100.0 + k, "bad" if k == 14 else None) for k in range(12, 20)]  # healed at step 12
    events = [
        {"event": "start", "replica": 0, "wall": 99.0, "t": 0.0},
        {"event": "start", "replica": 1, "wall": 99.0, "t": 0.0},
        {"event": "kill", "replica": 1, "wall": 107.5, "t": 8.5},
        {"event": "restart", "replica": 1, "wall": 110.0, "t": 11.0},
        {"event": "restart", "replica": 0, "wall": 200.0, "t": 101.0, "skipped": "the run ended first"},
    ]
    summary = {"final_val_loss": 2.5}
    startups = [{"event": "startup", "wall": 99.5, "process_s": 9.0},  # the first incarnation's: before the restart
                {"event": "startup", "wall": 111.5, "process_s": 1.25, "distributed_s": 0.1, "data_s": 0.05,
                 "model_s": 0.2, "outer_s": 0.1, "join_s": 0.3}]  # fmt: skip
    return {"events": events, "jobs": {"replica0": {"steps": r0, "summary": summary},
                                       "replica1": {"steps": first + second, "summary": summary,
                                                    "startups": startups}}}  # fmt: skip


def test_incarnations_and_useful_steps():
    incs = incarnations(_run()["jobs"]["replica1"]["steps"])
    assert [[x["step"] for x in i] for i in incs] == [list(range(8)), list(range(12, 20))]
    assert [x["step"] for x in useful(incs[0])] == [0, 1, 2, 3, 4]
    assert [x["step"] for x in useful(incs[1])] == list(range(12, 20))


def test_goodput_rejoin_and_digests_by_hand():
    res = analyze(_run(), tokens_per_step=10, replicas=2, rate_per_replica=10.0)
    # window (100, 119]: good steps 19 (replica 0) + 4 (steps 1-4) + 8 (steps 12-19) = 31; all steps 34
    assert res["complete"] and res["window_s"] == 19.0
    assert res["goodput"] == pytest.approx(310 / (2 * 10.0 * 19))
    assert res["tokens_lost"] == 30  # steps 5, 6, 7 of the killed incarnation
    assert res["outer_steps_compared"] == 4 and res["outer_steps_differing"] == [3]
    assert res["kills"] == 1
    [rj] = res["rejoins"]  # (the skipped restart is not an event)
    assert rj["job"] == "replica1" and rj["first_step_s"] == 2.0 and rj["first_outer_step_s"] == 4.0
    assert rj["at_step"] == 12 and res["final_val_loss"] == 2.5
    assert rj["startup"]["process_s"] == 1.25 and rj["startup"]["join_s"] == 0.3  # the restarted process's record
    undisturbed = analyze(_run(), 10, 2)  # its own rate: 34 steps x 10 tokens over 19 s, over 2 replicas
    assert undisturbed["tokens_per_s_per_replica"] == pytest.approx(340 / 19 / 2)
    text = markdown({"undisturbed": undisturbed, "churned": res, "replicas": 2, "method": "dilocox", "H": 5,
                     "steps": 20, "emulation": "loopback", "period": 30.0, "down": 10.0, "standby": 0,
                     "date": "d", "machine": "m", "command": "c", "loss_vs_equal_tokens_pct": 0.5})  # fmt: skip
    assert "| goodput (target ≥ 0.90) |" in text
    assert "| restart replica 1 | 11.0 | replica1 | 2.0 | 4.0 | 1.2, 0.1, 0.1, 0.2, 0.1, 0.3 |" in text


def test_digests_of_a_standby_and_a_replica_are_compared_together():
    jobs = {"replica0": {"steps": [_rec(4, 1.0)]}, "standby0": {"steps": [_rec(4, 2.0, "other")]}}
    assert digest_mismatches(jobs) == (1, [1])


def test_kill_schedule_is_seeded_and_every_restart_lands_in_the_run():
    kills, restarts = kill_schedule(4, 30.0, 10.0, 125.0, seed=3)
    assert [k.split("@")[1] for k in kills] == ["30", "60", "90"]  # 120 + 10 would land after the run
    assert [r.split("@")[1] for r in restarts] == ["40", "70", "100"]
    assert [k.split("@")[0] for k in kills] == [r.split("@")[0] for r in restarts]
    assert kill_schedule(4, 30.0, 10.0, 125.0, seed=3) == (kills, restarts)
    with pytest.raises(ValueError, match="--down"):
        kill_schedule(4, 10.0, 10.0, 100.0, seed=0)


def test_the_link_options_reach_both_launches(monkeypatch, tmp_path):
    """``--bandwidth``/``--latency``: the undisturbed and the churned launch both run behind the same link."""
    from dilocox.bench import churn

    seen = []

    def fake_launch(cfg_path, run_dir, replicas, overrides, netns, **kw):
        seen.append((os.path.basename(run_dir), {k: kw.get(k) for k in ("bandwidth", "latency")}))
        return _run()

    monkeypatch.setattr(churn, "_launch", fake_launch)
    out = tmp_path / "out"
    argv = ["--replicas", "2", "--steps", "20", "--period", "30", "--down", "10", "--bandwidth", "100mbit",
            "--latency", "50ms", "--no-netns", "--out", str(out)]  # fmt: skip
    assert churn.main(argv) == 0
    assert seen == [(name, {"bandwidth": "100mbit", "latency": "50ms"}) for name in ("undisturbed", "churned")]
