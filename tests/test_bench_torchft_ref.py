"""torchft's own DiLoCo as the reference row of the elastic benchmark (benchmarks/torchft_ref.py: a harness of the
source checkout, not installed with dilocox)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from dilocox.distributed.procs import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(ROOT, "benchmarks", "torchft_ref.py")


def _load_harness():
    """benchmarks/torchft_ref.py as a module (it is run by path, not imported as a package)."""
    spec = importlib.util.spec_from_file_location("benchmarks_torchft_ref", HARNESS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_ref = _load_harness()
run_reference, summarize, torchft_facts, wait_for_peers = (
    _ref.run_reference,
    _ref.summarize,
    _ref.torchft_facts,
    _ref.wait_for_peers,
)

try:
    import torchft  # noqa: F401

    HAVE_TORCHFT = True
except ImportError:
    HAVE_TORCHFT = False

SMALL = [
    "--data.max_bytes=200000",
    "--model.n_layers=2",
    "--model.d_model=64",
    "--train.seq_len=32",
    "--train.batch_size=2",
    "--train.eval_batches=1",
    "--optim.warmup_steps=1",
]


def _synthetic(heal_copies: bool = True) -> dict:
    """3 replicas, 1 step/s from wall 1000, H = 10, 60 steps. Replica 2 is SIGKILLed at 1025.5 (after step 25) and
    restarted at 1032.0; it trains its own steps 1..10 (walls 1035..1044; outer_step 0), then heals in the survivors'
    sync at step 50 (wall 1050) from replica 0 (its received params' sum = replica 0's pre-sync sum), counted by
    torchft as one of 3 participants; the survivors' syncs at 30 and 40 have 2 participants."""
    ev = [{"event": "start", "replica": r, "wall": 1000.0} for r in range(3)]
    ev += [{"event": "kill", "replica": 2, "wall": 1025.5}, {"event": "restart", "replica": 2, "wall": 1032.0}]
    reps = []
    for r in range(3):
        steps = []
        for s in range(1, 61):
            if r == 2 and s > 25:
                continue
            x = {"step": s, "loss": 3.0, "wall": 1000.0 + s, "tokens_per_s": 64.0, "outer_step": s // 10}
            if s % 10 == 0:
                x.update(participants=2 if 30 <= s <= 40 else 3, committed=True, pre_sync_sum=100.0 * s + r)
                x["sync_s"] = 2.0 + 0.1 * r if s == 30 else 0.2  # the first sync after the kill waits for detection
            steps.append(x)
        reps.append({"steps": steps, "summary": {"final_val_loss": 2.5 + 0.01 * r}})
    fresh = [{"step": s, "loss": 5.0, "wall": 1034.0 + s, "tokens_per_s": 64.0, "outer_step": 0} for s in range(1, 10)]
    src = 100.0 * 50 + 0 if heal_copies else 1.5
    heal = {"step": 50, "wall": 1050.0, "outer_step": 5, "participants": 3, "committed": True, "pre_sync_sum": 7.0}
    heal["sync_s"] = 0.2
    heal.update(healed=True, healed_from_sum=src, healed_at_step=10)
    after = [
        {"step": s, "wall": 1000.0 + s, "outer_step": s // 10, "loss": 2.9, "tokens_per_s": 64.0} for s in range(51, 61)
    ]
    reps[2]["steps"] += fresh + [heal] + after
    return {"events": ev, "replicas": reps}


def test_torchft_facts_find_the_heal_and_its_copied_pseudo_gradient():
    f = torchft_facts(_synthetic(), victim=2)
    assert f["healed"] and f["heal_step"] == 50
    assert f["heal_source_replica"] == 0  # the received params are replica 0's, bit for bit
    assert f["heal_participants"] == 3 and f["heal_peer_participants"] == [3]
    assert f["heal_counts_copy"] is True  # torchft divides by 3 with replica 0's pseudo-gradient in it twice
    assert f["rejoin_heal_s"] == pytest.approx(18.0)
    assert f["victim_steps_discarded"] == 10  # its steps 1..10: 9 records before the heal + the heal step
    assert f["participants_seen"] == [2, 3]
    assert f["median_sync_s"] == 0.2 and f["first_shrunk_sync_step"] == 30 and f["first_shrunk_sync_s"] == 2.1
    assert f["dead_to_shrunk_sync_s"] == pytest.approx(1030.0 - 1025.5)  # kill event -> sync 30 done
    assert f["final_val_loss"] == 2.5 and f["final_val_loss_per_replica"] == [2.5, 2.51, 2.52]
    other = torchft_facts(_synthetic(heal_copies=False), victim=2)
    assert other["healed"] and other["heal_source_replica"] is None and other["heal_counts_copy"] is False
    assert torchft_facts(_synthetic(), victim=1)["healed"] is False
    assert "healed" not in torchft_facts(_synthetic(), victim=None)


def test_summary_has_the_elastic_bench_fields():
    s = summarize(_synthetic(), 64, victim=2)
    # survivors' outer step 2 -> 3 lands with step 30 at wall 1030
    assert s["kill_to_next_outer_s"] == pytest.approx(1030.0 - 1025.5)
    assert s["rejoin_first_step_s"] == pytest.approx(3.0) and s["rejoin_at_step"] == 1
    assert s["rejoin_outer_step_s"] == pytest.approx(1050.0 - 1032.0)  # outer_step 0 -> 5 at the heal
    assert s["tokens_per_s_before"] > 0 and 0.5 < s["outage_ratio"] < 0.8
    assert s["heal_counts_copy"] is True and s["final_val_loss"] == 2.5


def test_run_reference_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="multiple of sync_every"):
        run_reference([], 2, 7, None, None, str(tmp_path / "x"), sync_every=2)
    with pytest.raises(ValueError, match="die_at='1@3' must be R@STEP"):
        run_reference([], 2, 8, None, None, str(tmp_path / "x"), sync_every=2, die_at="1@3")
    r = subprocess.run(
        [sys.executable, HARNESS, "--kill", "5@1", "--out", str(tmp_path / "y")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),  # run by path from anywhere
        env=child_env(),
    )
    assert r.returncode == 1 and "replica 5 is not in [0, 3)" in r.stderr, r.stderr


def test_the_harness_is_not_part_of_the_package():
    """benchmarks/ is the checkout's, not an installed package: no __init__.py, setup.py ships dilocox* only, and
    nothing under dilocox/ names the harness (tests/test_layout.py checks the imports)."""
    assert os.path.isfile(HARNESS) and not os.path.exists(os.path.join(ROOT, "benchmarks", "__init__.py"))
    assert 'find_packages(include=["dilocox*"])' in open(os.path.join(ROOT, "setup.py")).read()
    assert not os.path.exists(os.path.join(ROOT, "dilocox", "bench", "torchft_ref.py"))
    for d, _, files in os.walk(os.path.join(ROOT, "dilocox")):
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(d, f), encoding="utf-8").read()
                assert "torchft_ref" not in text, os.path.join(d, f)


def test_the_cli_and_the_benches_do_not_import_the_reference():
    """Neither torchft nor the harness is imported by ``dilocox.cli``, ``dilocox.bench``, the elastic bench module or
    ``dilocox bench elastic --help`` (torchft only lazily, in dilocox/elastic/torchft.py; a fresh interpreter: this
    test module loads the harness)."""
    code = (
        "import contextlib, io, sys\n"
        "import dilocox.bench, dilocox.bench.elastic, dilocox.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    dilocox.cli.main(['bench', 'elastic', '--help'])\n"
        "print(sorted(m for m in sys.modules if m.endswith('torchft_ref') or m.split('.')[0] == 'torchft'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_start_barrier_waits_for_every_first_incarnation_but_not_a_restart(tmp_path):
    d = str(tmp_path / "ready")
    t = time.monotonic()
    assert wait_for_peers(d, 0, 2, timeout_s=0.3) is False  # replica 1 never came: bounded, then goes on
    assert 0.3 <= time.monotonic() - t < 5
    assert wait_for_peers(d, 0, 2, timeout_s=30) is True  # replica 0 again = a restart: at once
    assert wait_for_peers(d, 1, 2, timeout_s=30) is True  # the last one completes the barrier
    assert sorted(os.listdir(d)) == ["replica0", "replica1"]


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TORCHFT, reason="torchft is not installed (pip install torchft==0.2.0)")
def test_two_replicas_without_a_kill_train_and_write_metrics(tmp_path):
    out = str(tmp_path / "ref")
    res = run_reference(SMALL, 2, 6, None, None, out, sync_every=2, timeout_s=600)
    assert res["exit_code"] == 0
    assert res["commits_per_replica"] == [3, 3] and res["failed_syncs_per_replica"] == [0, 0]
    assert res["participants_seen"] == [2]  # torchft averaged every sync over both replicas
    finals = res["final_val_loss_per_replica"]
    # different data per replica, yet the same outer params after the last sync: the all-reduce happened
    assert finals[0] == finals[1] and 0 < finals[0] < 10
    assert res["tokens_per_s"] > 0
    for r in range(2):
        recs = _records(os.path.join(out, f"replica{r}", "metrics.jsonl"))
        steps = [x for x in recs if "step" in x]
        assert [x["step"] for x in steps] == [1, 2, 3, 4, 5, 6]
        for x in steps:
            assert {"step", "loss", "wall", "tokens_per_s", "outer_step"} <= set(x)
        assert [x["step"] for x in steps if "val_loss" in x] == [4]  # eval_every = 2 H
        assert [x["outer_step"] for x in steps if "participants" in x] == [1, 2, 3]
        assert recs[-1]["summary"]["final_val_loss"] == finals[r] and recs[-1]["summary"]["torchft_heals"] == 0
    # the two replicas' losses differ (own data shards), so the equal final loss is not a coincidence
    paths = [os.path.join(out, f"replica{r}", "metrics.jsonl") for r in (0, 1)]
    losses = [[x["loss"] for x in _records(p) if "step" in x] for p in paths]
    l0, l1 = losses
    assert l0 != l1
    ev = [e["event"] for e in _records(os.path.join(out, "events.jsonl"))]
    assert ev.count("start") == 2 and ev.count("exit") == 2
    assert json.load(open(os.path.join(out, "results.json")))["commits_per_replica"] == [3, 3]


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TORCHFT, reason="torchft is not installed (pip install torchft==0.2.0)")
def test_replica_dying_before_its_quorum_is_dropped_after_the_heartbeat_timeout(tmp_path):
    """Replica 2 SIGKILLs itself right before its sync at step 4: the survivors' quorum for that sync forms only
    once the lighthouse drops it (heartbeat timeout 2 s), then both go on as a quorum of 2 with the same params."""
    out = str(tmp_path / "die")
    res = run_reference(SMALL, 3, 6, None, None, out, sync_every=2, die_at="2@4", timeout_s=600)
    assert res["exit_code"] != 0  # the victim's own SIGKILL; the survivors exited 0 (run_reference checked)
    assert res["participants_seen"] == [2, 3] and res["first_shrunk_sync_step"] == 4
    assert res["commits_per_replica"] == [3, 3, 1]
    victim = [x["step"] for x in _records(os.path.join(out, "replica2", "metrics.jsonl")) if "step" in x]
    assert victim == [1, 2, 3]  # it died before finishing step 4
    # its last record (step 3) precedes its death; the lighthouse kept it for heartbeat_timeout_ms after that
    assert res["dead_to_shrunk_sync_s"] >= 1.9
    fin = res["final_val_loss_per_replica"]
    assert fin[0] == fin[1] and fin[2] is None
