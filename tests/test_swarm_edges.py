"""Edges of SWARM mode found in review: what ``dilocox export`` takes after a resumed run that stopped early, flags
and config keys out of range or without effect, and a ``dilocox swarm`` stopped by SIGTERM (its peers must go too).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from dilocox.config import load_config, to_yaml
from dilocox.model.transformer import build_model, build_stage_model
from dilocox.swarm import checkpoint as peer_ckpt
from dilocox.swarm import cli
from dilocox.swarm.final import final_model
from dilocox.swarm.plan import main as plan_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


# ---------------------------------------------------------------------------------------------- export


def _save_checkpoint(out, cfg, stage, params, step):
    """A SWARM checkpoint of one stage as ``swarm/checkpoint.save`` writes it (a stand-in peer holding ``params``)."""
    model = torch.nn.Module()
    for k, v in params.items():
        *path, leaf = k.split(".")
        m = model
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, torch.nn.Module())
            m = getattr(m, p)
        m.register_parameter(leaf, torch.nn.Parameter(v.clone()))
    peer = SimpleNamespace(
        s=SimpleNamespace(sync="swarm"), group=None, cfg=cfg, out_dir=out, stage=stage, index=0, n=2, model=model,
        opt=torch.optim.AdamW(model.parameters()), outer=None, name=f"s{stage}p0",
    )  # fmt: skip
    assert peer_ckpt.save(peer, step) is not None


def test_export_after_a_resumed_run_that_stopped_early_takes_its_checkpoint_not_the_first_runs_pt(tmp_path):
    # run 1 finished at step 3 (s{j}p0.pt, records 0..3); `--resume --steps 100` then trained to step 7, saved a
    # complete checkpoint of step 6 and was stopped (timeout, kill): no new .pt, records 0..7. The export must be the
    # checkpoint of step 6; it was run 1's .pt of step 3 (its records end where the run's do: taken as finished).
    out = str(tmp_path)
    cfg = load_config(
        TINY,
        ["--model.n_layers=2", "--model.d_model=64", "--swarm.peers_per_stage=[1,1]", "--checkpoint.every=2",
         f"--checkpoint.dir={out}/checkpoints"],
    )  # fmt: skip
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    full = build_model(cfg.model, seed=0).state_dict()
    stage_keys = [build_stage_model(cfg.model, j, 2, device="meta").state_dict() for j in (0, 1)]
    parts = [{k: full[k].clone() for k in keys} for keys in stage_keys]
    for j, part in enumerate(parts):
        name = f"s{j}p0"
        first = [{"step": k, "loss": 1.0} for k in range(4)]
        torch.save({"params": part, "visits": [], "records": first}, os.path.join(out, f"{name}.pt"))
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps({"step": k, "loss": 1.0}) + "\n" for k in range(8))
        _save_checkpoint(out, cfg, j, {k: v * 2.0 for k, v in part.items()}, 6)
    got, source = final_model(out, cfg)
    assert source.endswith("step_00000006"), source
    assert all(torch.equal(got[k], full[k] * 2.0) for k in full)


# ---------------------------------------------------------------------------------------------- flags and keys


@pytest.mark.parametrize("item", ["s1p0=nan", "s1p0=inf"])
def test_delay_and_pace_must_be_finite(item):
    for flag in ("--delay", "--pace"):
        with pytest.raises(cli.SwarmUsageError, match=f"{flag} .*finite SECONDS >= 0"):
            cli.parse_delays([item], flag)


@pytest.mark.parametrize(
    "key", ["--train.max_tokens=256", "--train.device=cuda", "--train.dtype=bf16", "--train.compile=true"]
)
def test_train_keys_no_peer_reads_are_refused_before_anything_starts(key, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(cli.SwarmUsageError, match=f"{key[2:].split('=')[0]}=.*not supported in SWARM mode"):
        cli.main([TINY, "--peers", "1,1", "--steps", "2", "--out", str(out), key])
    assert not out.exists()


@pytest.mark.parametrize("max_s", ["nan", "-5", "inf"])
def test_store_and_rebalance_max_s_must_be_positive_and_finite(max_s):
    with pytest.raises(cli.SwarmUsageError, match="--max-s"):
        cli.main(["store", "--port", "29877", "--bind", "127.0.0.1", "--max-s", max_s])
    with pytest.raises(cli.SwarmUsageError, match="--max-s"):
        cli.main(["rebalance", "--config", TINY, "--store", "127.0.0.1:1", "--out", "/nonexistent", "--max-s", max_s])


def test_more_peers_than_one_host_holds_is_refused_before_any_starts(tmp_path):
    with pytest.raises(cli.SwarmUsageError, match="9999999999 peers on this host, at most 256"):
        cli.main([TINY, "--peers", "9999999998,1", "--steps", "1", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("peers", ["1,,2", "2,", ",2"])
def test_plan_peers_with_an_empty_item_is_an_error(peers, capsys):
    assert plan_main(["--stages", "2", "--peers", peers, "--model", "gpt2-small"]) == 2
    assert f"--peers {peers!r}" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- SIGTERM


def _peer_pids(out: str) -> list[int]:
    """PIDs of live processes whose command line names ``out`` (the job's peers)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{d}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if b"dilocox.swarm.peer" in cmd and out.encode() in cmd and state != b"Z":
            pids.append(int(d))
    return pids


@pytest.mark.slow
def test_sigterm_to_dilocox_swarm_stops_every_peer(tmp_path):
    out = str(tmp_path / "out")
    argv = [
        sys.executable, "-c", "import sys; from dilocox.cli import main; sys.exit(main())", "swarm", TINY,
        "--peers", "1,1", "--steps", "100000", "--out", out,
        "--model.n_layers=2", "--model.d_model=64", "--train.seq_len=32", "--data.max_bytes=200000",
        "--log.tensorboard=false", "--swarm.startup_timeout_s=120", "--timeout-s", "200",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while len(_peer_pids(out)) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.2)
        assert len(_peer_pids(out)) == 2, launcher.communicate(timeout=30)[0].decode()[-3000:]
        launcher.send_signal(signal.SIGTERM)  # (the peers are starting: before the fix they waited for the store)
        text = launcher.communicate(timeout=60)[0].decode()
        assert launcher.returncode == 128 + signal.SIGTERM, text[-3000:]
        assert "interrupted (SIGTERM); every peer was stopped" in text
        # and whether it can be resumed (it said nothing: a plain rerun is refused, --resume is what resumes)
        assert f"swarm job: no complete SWARM checkpoint in {out}/checkpoints yet (checkpoint.every=" in text, text
        deadline = time.monotonic() + 10
        while _peer_pids(out) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _peer_pids(out) == [], "peers outlived the launcher's SIGTERM"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)
        for pid in _peer_pids(out):
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except OSError:
                pass


@pytest.mark.parametrize("entry", [["-m", "dilocox.cli", "swarm", "peer"], ["-m", "dilocox.swarm.peer"]])
def test_a_hand_started_peer_outside_the_layout_or_without_its_store_is_one_line(entry, tmp_path):
    """Both entry points (the CLI's and swarm.sbatch's ``python -m dilocox.swarm.peer``): a peer outside the layout is
    refused before the store is dialled (exit 2), and a store that never answers is one line (exit 3), no traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, *entry, "--config", TINY, "--index", "0", "--store", "127.0.0.1:1", "--out", str(tmp_path)]
    for stage, code, want in ((5, 2, r"peer (stage=5, index=0) is outside swarm.peers_per_stage"),
                              (0, 3, "the SWARM address store at 127.0.0.1:1 did not")):  # fmt: skip
        over = ["--", "--security.authenticate=false", "--swarm.startup_timeout_s=1"]
        r = subprocess.run([*base, "--stage", str(stage), *over], capture_output=True, text=True, timeout=90, env=env)
        assert r.returncode == code, r.stderr[-2000:]
        assert want in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
