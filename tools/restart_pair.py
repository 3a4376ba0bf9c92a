"""A paired restart-speed run (issue 22 item 5): torchft's own DiLoCo (``benchmarks/torchft_ref.py``) and dilocox's
elastic replicas (``dilocox launch --elastic``), back to back on the same machine, 3 replicas x 1 rank, the same
tiny GPT-2 and ``configs/methods/diloco.yaml``, replica 2 SIGKILLed at 25 s and restarted at 35 s (wall), loopback.

    OMP_NUM_THREADS=1 python -m tools.restart_pair [--steps 300] [--out /tmp/restart_pair]

Prints, for each, from the victim's ``metrics.jsonl`` after its restart (wall = epoch seconds):
- ``healed_s``: restart -> back in step with the live replicas holding their state (torchft: its first outer step,
  the sync where it is healed; dilocox: its first step record, after the round it joined);
- ``own_outer_s``: restart -> the first outer step its own pseudo-gradient enters (torchft counts a healed
  replica's copy of the source's at the heal sync, so that is the sync after it; dilocox: its next outer step);
- ``first_step_s``: restart -> its first step record of any kind (torchft trains from a fresh start before it
  heals, dilocox does not).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def torchft_reference() -> str:
    """The path of the torchft reference harness, ``benchmarks/torchft_ref.py`` of the checkout that dilocox is
    imported from (it is not installed with the package); SystemExit in one line when that is not a checkout."""
    import dilocox

    root = os.path.dirname(os.path.dirname(os.path.abspath(dilocox.__file__)))
    path = os.path.join(root, "benchmarks", "torchft_ref.py")
    if not os.path.isfile(path):
        raise SystemExit(
            f"restart_pair: torchft's reference run needs a source checkout (benchmarks/torchft_ref.py, not "
            f"installed with dilocox); dilocox here is imported from {root}: git clone the repository, pip install -e ."
        )
    return path


def victim_times(run_dir: str, victim: int = 2) -> dict:
    """The victim's restart timings (module docstring) from a run dir of either runner."""
    events = _records(os.path.join(run_dir, "events.jsonl"))
    t0 = next(e["wall"] for e in events if e["event"] == "restart" and e.get("replica") == victim)
    recs = [r for r in _records(os.path.join(run_dir, f"replica{victim}", "metrics.jsonl")) if "step" in r]
    after = [r for r in recs if r["wall"] > t0]
    first = after[0]
    outers, seen = [], first.get("outer_step")
    for r in after:
        if r.get("outer_step") is not None and r["outer_step"] != seen:
            outers.append(r)
            seen = r["outer_step"]
    torchft = first.get("outer_step") == 0 and outers and outers[0].get("healed")
    healed = outers[0] if torchft else first
    own = outers[1] if torchft else outers[0]
    return {
        "first_step_s": round(first["wall"] - t0, 2),
        "healed_s": round(healed["wall"] - t0, 2),
        "own_outer_s": round(own["wall"] - t0, 2),
        "healed_at_step": healed["step"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.restart_pair", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="/tmp/restart_pair")
    a = ap.parse_args(argv)
    from dilocox.bench.runner import write_config
    from dilocox.distributed.procs import child_env

    ref = torchft_reference()
    os.makedirs(a.out, exist_ok=True)
    cfg = write_config(
        os.path.join(a.out, "diloco.yaml"), ["tiny.yaml", "methods/diloco.yaml"], "parallel: {replicas: 1}\n"
    )
    env = dict(child_env(), OMP_NUM_THREADS="1")
    tf, dx = os.path.join(a.out, "torchft"), os.path.join(a.out, "dilocox")
    for d in (tf, dx):
        shutil.rmtree(d, ignore_errors=True)
    sched = ["--kill", "2@25", "--restart", "2@35"]
    subprocess.run(
        [sys.executable, ref, "--replicas", "3", "--steps", str(a.steps),
         "--sync-every", "10", *sched, "--out", tf],
        env=env, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "dilocox.cli", "launch", "--elastic", "3", cfg, "--outer.sync_every=10",
         f"--train.steps={a.steps}", "--train.eval_every=50", "--checkpoint.every=0", "--log.every=1",
         "--log.progress=false", "--log.tensorboard=false", f"--log.run_dir={dx}", *sched, "--no-netns"],
        env=env, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    out = {"torchft": victim_times(tf), "dilocox": victim_times(dx)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
