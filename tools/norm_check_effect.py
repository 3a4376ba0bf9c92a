"""What ``outer.norm_check`` does to the loss (issue 21): 3 DiLoCo replicas of the tiny GPT-2, one of them poisoned.

    OMP_NUM_THREADS=1 python -m tools.norm_check_effect [--steps 300] [--out /tmp/norm_check]

Scenarios (each a `dilocox train` of 3 replicas x 1 rank on this machine, the same seed and data): honest without
and with the check (does it ever reject an honest replica?), replica 2 sending -20 x its pseudo-gradient without and
with the check, and replica 2 sending 3.9 x its own (just under the check's 4 x the median: what an attacker who
knows the threshold can still do) with the check. The poisoning is a patch of ``FixedGroup.allreduce_mean`` in the
rank's own process (``--rank-entry``), not a switch of the product. Prints the final validation loss of each and how
many outer steps left a replica out (from the ranks' logs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = [  # name, poison factor of replica 2 (None: honest), outer.norm_check
    ("honest", None, 0.0),
    ("honest + check", None, 4.0),
    ("-20x", -20.0, 0.0),
    ("-20x + check", -20.0, 4.0),
    ("3.9x + check", 3.9, 4.0),
]


def rank_entry(argv: list[str]) -> int:
    """One torchrun rank: poison this rank's outer contribution if it is ``POISON_RANK``, then ``dilocox train``."""
    factor = os.environ.get("POISON_FACTOR")
    if factor and os.environ.get("RANK") == os.environ.get("POISON_RANK"):
        from dilocox.outer.group import FixedGroup

        orig = FixedGroup.allreduce_mean

        def poisoned(self, tensors, step, *a, **kw):
            return orig(self, [t * float(factor) for t in tensors], step, *a, **kw)

        FixedGroup.allreduce_mean = poisoned
    from dilocox.cli import main

    return main(["train", *argv])


def run(name: str, factor: float | None, check: float, steps: int, out: str) -> dict:
    run_dir = os.path.join(out, name.replace(" ", "").replace("+", "_"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, POISON_RANK="2", POISON_FACTOR=str(factor or ""))
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
        "-m", "tools.norm_check_effect", "--rank-entry", os.path.join(ROOT, "configs", "tiny.yaml"),
        "--parallel.replicas=3", "--outer.method=diloco", "--outer.sync_every=20", f"--train.steps={steps}",
        "--train.eval_every=0", "--checkpoint.every=0", "--log.progress=false", "--log.tensorboard=false",
        f"--outer.norm_check={check}", f"--log.run_dir={run_dir}", "--checkpoint.resume=none",
    ]  # fmt: skip
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"{name}: exit {p.returncode}\n{p.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        summary = [json.loads(x)["summary"] for x in f if '"summary"' in x][-1]
    left_out = p.stderr.count("left out of the mean by outer.norm_check")
    return {"scenario": name, "final_val_loss": summary["final_val_loss"], "left_out_lines": left_out}


def main() -> int:
    if sys.argv[1:2] == ["--rank-entry"]:
        return rank_entry(sys.argv[2:])
    ap = argparse.ArgumentParser(prog="python -m tools.norm_check_effect", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="/tmp/norm_check")
    a = ap.parse_args()
    rows = [run(n, f, c, a.steps, a.out) for n, f, c in SCENARIOS]
    print("| scenario | final val loss | outer-step log lines with a replica left out (3 ranks log each) |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['scenario']} | {r['final_val_loss']:.4f} | {r['left_out_lines']} |")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
