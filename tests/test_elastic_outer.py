"""DiLoCoOuter over the elastic (torchft) outer group against the oracle with a membership schedule (issue 10).

Three replicas of the oracle's TinyNet run (``tests/elastic_worker.py``), each its own process under a
time bound, killed (process group) in ``finally``; the lighthouse runs in the test process. Replica 2
is SIGKILLed mid-phase or while its peers' outer all-reduce is in flight; optionally restarted with
the same command: it must heal from a live replica, contribute nothing in that step, and be bit-identical
to the survivors from then on. The survivors' params must equal ``run_reference`` given the membership
each outer step was averaged over (and a fresh inner optimizer for the joiner).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.reference_diloco import run_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, H, SEED = 48, 4, 7


def _records(path: str) -> list[dict]:
    from tests.spawn import read_records

    return read_records(path)


def _run(
    tmp_path,
    overlap: str,
    die_mode: str,
    die_at: int,
    restart: bool,
    sleep: float,
    bound_s: float = 240,
    compress: tuple[str, ...] = (),
    per_replica: dict[int, list[str]] | None = None,
):
    pytest.importorskip("torchft", reason="torchft==0.2.0 is not installed (pip install torchft==0.2.0)")
    from dilocox.elastic import start_lighthouse

    # heartbeat 3 s, not 1.5: once in CI (2 workers, each with 3-4 torch processes on 2 cores) replica 0 was left
    # alone waiting for a quorum after the others had finished; a replica whose heartbeat stalls past the timeout
    # is left out of rounds, the suspected cause (not proven: _why() prints every replica's state if it recurs)
    lh = start_lighthouse(2, heartbeat_timeout_ms=3000, join_timeout_ms=20000)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def cmd(r: int, die: bool) -> list[str]:
        c = [sys.executable, "-m", "tests.elastic_worker", "--lighthouse", lh.address(), "--replica", str(r)]
        c += ["--out", str(tmp_path / f"r{r}"), "--steps", str(STEPS), "--H", str(H), "--overlap", overlap]
        c += ["--seed", str(SEED), "--timeout", "8", "--quorum-timeout", "40", "--step-sleep", str(sleep), *compress]
        if restart:  # the survivors wait at step 16 (bounded) until the restarted replica has joined
            c += ["--hold-file", str(tmp_path / "joined"), "--hold-at", "16"]
        c += (per_replica or {}).get(r, [])
        if die and die_at is not None:
            c += ["--die-at", str(die_at), "--die-mode", die_mode]
        else:
            c += ["--initial-replicas", "3"] if not (restart and r == 2) else []
        return c

    def start(r: int, die: bool) -> subprocess.Popen:
        return subprocess.Popen(
            cmd(r, die) if not (die and r == 2) else cmd(r, True) + ["--initial-replicas", "3"],
            cwd=ROOT,
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / f"r{r}.err", "a"),
        )

    procs = [start(0, False), start(1, False), start(2, True)]
    t_restart = None
    try:
        deadline = time.monotonic() + bound_s
        if restart:  # same command, started as soon as it is gone (start-up takes seconds on 2 loaded cores)
            assert procs[2].wait(timeout=bound_s) == -signal.SIGKILL
            t_restart = time.time()
            procs.append(start(2, False))
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        lh.shutdown()
    return procs, [_records(str(tmp_path / f"r{r}.jsonl")) for r in range(3)], t_restart


def _launched(recs: list[dict], overlap: str) -> list[list[int]]:
    """Contributors of the all-reduce launched at each sync (delayed: it is waited for one sync later)."""
    seen = [x["contributors"] for x in recs if x["event"] == "sync"]
    if overlap == "none":
        return seen
    return seen[1:] + [next(x["contributors"] for x in recs if x["event"] == "done")]


def _final(tmp_path, r: int) -> dict[str, torch.Tensor]:
    return torch.load(tmp_path / f"r{r}.pt")


def _err(tmp_path, r: int) -> str:
    with open(tmp_path / f"r{r}.err") as f:
        return "".join(line for line in f if "[INFO]" not in line)[-3000:]


def _why(tmp_path, procs) -> str:
    """Every replica's exit code, last records and stderr: enough to tell a lost quorum's cause (who was done, who
    was behind) from a CI log alone (the run's tmp dir is gone by then)."""
    out = [f"exit codes {[p.returncode for p in procs]} (replicas 0, 1, 2, then 2 restarted)"]
    for r in range(3):
        recs = _records(str(tmp_path / f"r{r}.jsonl")) if (tmp_path / f"r{r}.jsonl").exists() else []
        out += [f"--- replica {r}: last records {recs[-4:]}", _err(tmp_path, r)[-1500:]]
    return "\n".join(out)


@pytest.mark.fault
@pytest.mark.slow  # ~60-90 s: 3-4 replica processes with torchft on 2 shared cores
@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_kill9_mid_phase_then_rejoin_matches_oracle(tmp_path, overlap):
    """Replica 2 is SIGKILLed mid-phase (inner step 6 of H=4 phases) and restarted at once: the survivors'
    syncs are averaged over {0,1} until it is back, its heal step over {0,1} (it adds nothing), then {0,1,2};
    the survivors' final params equal the oracle given that membership; the rejoined replica's equal theirs
    bit for bit; it continues at a later inner step than it died at (no sample trained twice)."""
    procs, recs, _ = _run(tmp_path, overlap, "phase", die_at=6, restart=True, sleep=0.4)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, _why(tmp_path, procs)
    assert procs[3].returncode == 0, _why(tmp_path, procs)
    syncs = [x for x in recs[0] if x["event"] == "sync"]
    assert [x["step"] for x in syncs] == list(range(H, STEPS + 1, H))
    members = _launched(recs[0], overlap)
    assert members == _launched(recs[1], overlap)
    assert members[0] == [0, 1, 2] and members[1] == [0, 1], members  # died in phase 2
    starts = [x for x in recs[2] if x["event"] == "start"]
    assert len(starts) == 2 and starts[1]["healed"], starts
    n_join = starts[1]["step"]
    t_join = n_join // H
    assert n_join % H == 0 and 2 <= t_join < STEPS // H, starts
    assert members[t_join - 1] == [0, 1], "the healing replica must not contribute to its heal step"
    assert all(m == [0, 1, 2] for m in members[t_join:]), members
    died_at = max(x["step"] for x in recs[2] if x["event"] == "step" and x["t"] < starts[1]["t"])
    assert n_join > died_at, "the rejoined replica re-trained steps (samples) it had trained before"
    ref = run_reference(3, STEPS, SEED, H, overlap=overlap, members=members, fresh_inner={t_join: [2]})
    got = [_final(tmp_path, r) for r in range(3)]
    for k in got[0]:
        assert torch.equal(got[0][k], got[1][k]) and torch.equal(got[0][k], got[2][k]), k
        torch.testing.assert_close(got[0][k], ref[0][k], rtol=1e-5, atol=1e-6)
    # the oracle would differ had the dead replica been averaged in (the check has teeth)
    wrong = run_reference(3, STEPS, SEED, H, overlap=overlap)
    assert any((wrong[0][k] - got[0][k]).abs().max() > 1e-4 for k in got[0])


@pytest.mark.fault
@pytest.mark.slow  # ~30 s
def test_muon_outer_state_heals_with_the_replica(tmp_path):
    """outer.optimizer=muon across a kill and a live join: the heal carries Muon's own momentum with θ and v, so the
    rejoined replica ends bit-equal to the survivors (a joiner that started Muon's momentum from zero would not:
    tests/test_outer_optimizer.py shows it on one outer step). No oracle here: torch's Muon orthogonalizes in bf16,
    so the fp32 rounding of torchft's sum (not the oracle's) moves the trajectory by far more than any tolerance."""
    muon = ("--outer-optimizer", "muon")
    procs, recs, _ = _run(tmp_path, "none", "phase", die_at=6, restart=True, sleep=0.4, compress=muon)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, _why(tmp_path, procs)
    assert procs[3].returncode == 0, _why(tmp_path, procs)
    members = _launched(recs[0], "none")
    starts = [x for x in recs[2] if x["event"] == "start"]
    assert len(starts) == 2 and starts[1]["healed"], starts
    t_join = starts[1]["step"] // H
    assert members[t_join - 1] == [0, 1] and all(m == [0, 1, 2] for m in members[t_join:]), members
    got = [_final(tmp_path, r) for r in range(3)]
    for k in got[0]:
        assert torch.equal(got[0][k], got[1][k]) and torch.equal(got[0][k], got[2][k]), k
    sgd = run_reference(3, STEPS, SEED, H, members=members, fresh_inner={t_join: [2]})
    assert any((sgd[0][k] - got[0][k]).abs().max() > 1e-3 for k in got[0])  # (Muon really ran)


@pytest.mark.fault
@pytest.mark.slow  # ~40-60 s
def test_kill9_while_allreduce_in_flight_survivors_go_on(tmp_path):
    """Delayed overlap: replica 2 dies once the quorum of its sync at step 8 has formed (its peers' all-reduce with
    it is in flight): that step is retried among the survivors (never applied half), every later step averages
    over {0,1}, the survivors match the oracle and each other, within the timeout + a phase."""
    procs, recs, _ = _run(tmp_path, "delayed", "inflight", die_at=8, restart=False, sleep=0.1)
    assert procs[2].returncode == -signal.SIGKILL
    assert procs[0].returncode == 0 and procs[1].returncode == 0, _why(tmp_path, procs)
    syncs = [x for x in recs[0] if x["event"] == "sync"]
    launched = _launched(recs[0], "delayed")
    assert launched == _launched(recs[1], "delayed")
    assert launched[0] == [0, 1, 2] and all(m == [0, 1] for m in launched[1:]), launched
    t_kill = next(x["t"] for x in recs[2] if x["event"] == "kill")
    after = next(x for x in syncs if x["t"] > t_kill)
    assert after["t"] - t_kill < 8 + 1.5 + H * 0.5 + 10, after
    ref = run_reference(3, STEPS, SEED, H, overlap="delayed", members=launched)
    got = [_final(tmp_path, r) for r in range(2)]
    for k in got[0]:
        assert torch.equal(got[0][k], got[1][k]), k
        torch.testing.assert_close(got[0][k], ref[0][k], rtol=1e-5, atol=1e-6)


@pytest.mark.fault
@pytest.mark.slow  # ~60-90 s
def test_compressed_outer_allreduce_across_kill_and_rejoin(tmp_path):
    """Low-rank + int4 outer all-reduce (the compressor's own collectives over the torchft quorum's group), delayed
    overlap: replica 2 killed mid-phase and restarted; all syncs complete, the heal step leaves the joiner out, and
    the three replicas end bit-identical (Q warm starts shared, the joiner's error feedback reset)."""
    procs, recs, _ = _run(
        tmp_path, "delayed", "phase", die_at=6, restart=True, sleep=0.4, compress=("--quant", "int4", "--lowrank", "2")
    )
    assert all(p.returncode == 0 for p in (procs[0], procs[1], procs[3])), _why(tmp_path, procs)
    members = _launched(recs[0], "delayed")
    starts = [x for x in recs[2] if x["event"] == "start"]
    t_join = starts[1]["step"] // H
    assert starts[1]["healed"] and members[1] == [0, 1] and members[t_join - 1] == [0, 1], (members, starts)
    assert all(m == [0, 1, 2] for m in members[t_join:]), members
    got = [_final(tmp_path, r) for r in range(3)]
    for k in got[0]:
        assert torch.equal(got[0][k], got[1][k]) and torch.equal(got[0][k], got[2][k]), k


@pytest.mark.fault
@pytest.mark.slow  # ~60-90 s
def test_adaptive_rank_and_h_across_kill_and_rejoin(tmp_path):
    """DiLoCoX's adaptive controller in elastic mode (issue 22 item 1): low-rank + int4, delayed overlap, rank and
    H adapted every outer step (each replica proposing its own H sequence, ``--vary-h``). Replica 2 is killed
    mid-phase and restarted: the H proposals ride on each step's all-reduce (the max over that step's
    contributors), a joiner receives the rank window and the rank with θ, so every replica takes the same (rank, H)
    at every outer step, and the three end bit-identical."""
    procs, recs, _ = _run(
        tmp_path,
        "delayed",
        "phase",
        die_at=6,
        restart=True,
        sleep=0.4,
        compress=("--quant", "int4", "--lowrank", "2", "--adaptive", "--vary-h"),
    )
    assert all(p.returncode == 0 for p in (procs[0], procs[1], procs[3])), _why(tmp_path, procs)
    starts = [i for i, x in enumerate(recs[2]) if x["event"] == "start"]
    assert len(starts) == 2 and recs[2][starts[1]]["healed"], recs[2]
    recs[2] = recs[2][starts[1] :]  # the restarted incarnation's records
    syncs = [{x["outer_step"]: (x["rank"], x["H"], x["contributors"]) for x in r if x["event"] == "sync"} for r in recs]
    joined = sorted(syncs[2])  # the restarted replica's outer steps after its heal step
    assert len(joined) >= 3, syncs[2]
    for s in joined:  # the same decisions on all three, from the same averaged statistics and agreed proposals
        assert syncs[0][s][:2] == syncs[1][s][:2] == syncs[2][s][:2], (s, syncs[0][s], syncs[1][s], syncs[2][s])
    assert syncs[0][max(joined)][2] == [0, 1, 2]
    decided = [v[:2] for _, v in sorted(syncs[0].items())]
    assert len(set(decided)) > 1 and any(h != H for _, h in decided), decided  # the controller really moved them
    assert len({syncs[2][s][1] for s in joined}) > 1, syncs[2]  # H changed after the join too
    got = [_final(tmp_path, r) for r in range(3)]
    for k in got[0]:
        assert torch.equal(got[0][k], got[1][k]) and torch.equal(got[0][k], got[2][k]), k


@pytest.mark.fault
@pytest.mark.slow  # ~60-90 s
@pytest.mark.parametrize("quant", ["none", "int4", "sparse"])
def test_streaming_fragments_across_kill_and_rejoin_match_oracle(tmp_path, quant):
    """Streaming DiLoCo in elastic mode (issue 22 item 2): K = 2 strided fragments, launched tau = 1 step before their
    syncs, α = 0.5 mixing, overlap none; each fragment's all-reduce is its own quorum round. Replica 2 is killed
    mid-phase and restarted: it joins whichever fragment's round comes next (it learns which from its heal), adds
    nothing to it, starts every fragment from θ with a new AdamW, takes that round's average at the fragment's sync
    tau steps later, and contributes from the next round on. The final params of all three equal the oracle given
    that membership; the oracle without the rejoin (the replica's own params kept) differs. int4: the fragment's
    compressor carries the joiner's round (the shapes of that fragment); sparse (the dilocox preset's codec, an
    all-gather with error feedback): the same, and the three end bit-equal."""
    tau = 1
    extra = ("--fragments", "2", "--tau", str(tau), "--alpha", "0.5", "--quant", quant)
    procs, recs, _ = _run(tmp_path, "none", "phase", die_at=6, restart=True, sleep=0.4, compress=extra)
    assert all(p.returncode == 0 for p in (procs[0], procs[1], procs[3])), _why(tmp_path, procs)
    syncs = [x for x in recs[0] if x["event"] == "sync"]
    assert [x["step"] for x in syncs] == list(range(H // 2, STEPS + 1, H // 2))  # a fragment syncs every H/K steps
    members = [x["contributors"] for x in syncs]
    assert members == [x["contributors"] for x in recs[1] if x["event"] == "sync"]
    starts = [x for x in recs[2] if x["event"] == "start"]
    assert len(starts) == 2 and starts[1]["healed"], starts
    n_join = starts[1]["step"]
    t_join = next(t for t, x in enumerate(syncs, 1) if x["step"] - tau == n_join)  # the round it joined (1-based)
    assert members[0] == [0, 1, 2] and members[t_join - 1] == [0, 1], (members, t_join)
    assert all(m == [0, 1, 2] for m in members[t_join:]), members
    ref = run_reference(
        3, STEPS, SEED, H, K=2, tau=tau, alpha=0.5, pattern="strided", members=members, rejoin={t_join: [2]}
    )
    got = [_final(tmp_path, r) for r in range(3)]
    for k in got[0]:  # the same θ on all three: the joiner got θ and v and took the same averages
        assert torch.equal(got[0][k], got[1][k]) and torch.equal(got[0][k], got[2][k]), k
        if quant == "none":  # (the oracle averages in fp32; int4's rounding is checked against it elsewhere)
            torch.testing.assert_close(got[0][k], ref[0][k], rtol=1e-5, atol=1e-6)
    if quant == "none":  # the check has teeth: had the joiner kept its own params, θ would differ
        wrong = run_reference(3, STEPS, SEED, H, K=2, tau=tau, alpha=0.5, pattern="strided", members=members)
        assert any((wrong[0][k] - got[0][k]).abs().max() > 1e-4 for k in got[0])


@pytest.mark.slow  # ~20 s each: 3 replica processes with torchft
@pytest.mark.parametrize("poison", ["50", "nan"])
def test_norm_check_leaves_a_poisoned_replica_out_of_every_elastic_mean(tmp_path, poison):
    """outer.norm_check on the torchft quorum (issue 21): replica 2 sends 50 x its pseudo-gradient (or NaN) at every
    sync; with norm_check 4 every outer mean is over replicas 0 and 1 only (the accepted contributors each sync), all
    three end bit-equal and equal to the oracle averaged over {0, 1}; without the check the mean would differ."""
    check = ["--norm-check", "4"]
    procs, recs, _ = _run(tmp_path, "none", "phase", die_at=None, restart=False, sleep=0.05,
                          compress=tuple(check), per_replica={2: ["--poison", poison]})  # fmt: skip
    assert all(p.returncode == 0 for p in procs), _why(tmp_path, procs)
    members = _launched(recs[0], "none")
    assert len(members) == STEPS // H and all(m == [0, 1] for m in members), members
    assert _launched(recs[2], "none") == members  # the poisoned replica sees the same (it is told it was left out)
    ref = run_reference(3, STEPS, SEED, H, members=members)
    got = [_final(tmp_path, r) for r in range(3)]
    for k in got[0]:
        assert torch.equal(got[0][k], got[1][k]) and torch.equal(got[0][k], got[2][k]), k
        torch.testing.assert_close(got[0][k], ref[0][k], rtol=1e-5, atol=1e-6)
    wrong = run_reference(3, STEPS, SEED, H)
    assert any((wrong[0][k] - got[0][k]).abs().max() > 1e-4 for k in got[0])


@pytest.mark.slow  # ~20 s: 3 replica processes with torchft
def test_the_dilocox_presets_schedule_and_codec_over_the_quorum_match_the_oracle(tmp_path):
    """The dilocox preset's shape (K = 2 strided fragments, tau = 1, alpha = 0.5, top-k of chunks in 2 bits with error
    feedback) through the torchft quorum, no fault: every fragment round averages all three, and the final params
    equal the oracle's (tests/reference_diloco.py, the same codec in plain loops)."""
    sparse = dict(chunk=64, density=0.09, bits=2, ef_decay=0.95)  # (tests/elastic_worker.py --quant sparse)
    extra = ("--fragments", "2", "--tau", "1", "--alpha", "0.5", "--quant", "sparse")
    procs, recs, _ = _run(tmp_path, "none", "phase", die_at=None, restart=False, sleep=0.05, compress=extra)
    assert all(p.returncode == 0 for p in procs), _why(tmp_path, procs)
    syncs = [x for x in recs[0] if x["event"] == "sync"]
    assert len(syncs) == STEPS // (H // 2) and all(x["contributors"] == [0, 1, 2] for x in syncs)
    ref = run_reference(3, STEPS, SEED, H, K=2, tau=1, alpha=0.5, pattern="strided", sparse=sparse)
    dense = run_reference(3, STEPS, SEED, H, K=2, tau=1, alpha=0.5, pattern="strided")
    got = [_final(tmp_path, r) for r in range(3)]
    for k in got[0]:
        assert torch.equal(got[0][k], got[1][k]) and torch.equal(got[0][k], got[2][k]), k
        torch.testing.assert_close(got[0][k], ref[0][k], rtol=1e-5, atol=1e-6)
    assert any((dense[0][k] - got[0][k]).abs().max() > 1e-3 for k in got[0])  # the codec made a difference
