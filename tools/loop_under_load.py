"""Run tests again and again with busy loops competing for the cores: the flakiness check of issue 19.

    python -m tools.loop_under_load                      # every test marked `fault`, 20 rounds, 2 busy loops
    python -m tools.loop_under_load -n 5 --busy 2 tests/test_swarm_runtime.py::test_peer_killed_mid_step
    python -m tools.loop_under_load -m "fault and not slow" -n 3 --out /tmp/loop.json

Each round is one ``pytest`` process over the selection (so every round starts from fresh interpreters,
as CI does). The busy loops are plain ``while True: pass`` processes; they are started before the first
round and killed on every exit path (the end, the first failure with ``--stop``, Ctrl-C). It prints one
line per round and, at the end, each test's pass count and its slowest wall time, and exits 1 if any
test failed in any round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from dilocox.distributed.procs import kill_and_reap, spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [spawn([sys.executable, "-c", "while True: pass"]) for _ in range(max(0, n))]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        kill_and_reap(p, what="busy loop")


def read_junit(path: str) -> dict[str, tuple[str, float]]:
    """test id -> (outcome, seconds) from a pytest junit XML file."""
    out: dict[str, tuple[str, float]] = {}
    if not os.path.exists(path):
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        out[tid] = (outcome, float(case.get("time") or 0.0))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.loop_under_load", description=__doc__.splitlines()[0])
    ap.add_argument("tests", nargs="*", help="pytest node ids or files (default: the whole tests/ dir, with -m)")
    ap.add_argument("-n", "--rounds", type=int, default=20)
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes competing for the cores (default 2)")
    ap.add_argument("-m", "--marker", default="fault", help="pytest -m expression (default: fault)")
    ap.add_argument("-j", "--workers", type=int, default=1, help="pytest-xdist workers per round (default 1: serial)")
    ap.add_argument("--stop", action="store_true", help="stop at the first round with a failure")
    ap.add_argument("--round-timeout", type=float, default=3600.0, help="seconds one round may take")
    ap.add_argument("--out", help="write the per-test counts and times here as JSON")
    a = ap.parse_args(argv)

    env = dict(os.environ, OMP_NUM_THREADS="1")
    counts: dict[str, dict] = {}
    loops = busy_loops(a.busy)
    failed_rounds = 0
    t_all = time.monotonic()
    try:
        for k in range(1, a.rounds + 1):
            with tempfile.TemporaryDirectory(prefix="loop_") as tmp:
                xml = os.path.join(tmp, "junit.xml")
                cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", xml]
                cmd += ["-m", a.marker] if a.marker else []
                cmd += ["-n", str(a.workers)] if a.workers > 1 else []
                cmd += a.tests or ["tests"]
                t0 = time.monotonic()
                try:
                    rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=a.round_timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = -1
                res = read_junit(xml)
            for tid, (outcome, secs) in res.items():
                c = counts.setdefault(tid, {"passed": 0, "failed": 0, "skipped": 0, "max_s": 0.0})
                c[outcome] += 1
                c["max_s"] = max(c["max_s"], secs)
            bad = sorted(t for t, (o, _) in res.items() if o == "failed")
            skipped = sorted(t for t, (o, _) in res.items() if o == "skipped")
            failed_rounds += bool(bad or rc not in (0, 5))
            print(
                f"round {k}/{a.rounds}: rc={rc} tests={len(res)} failed={len(bad)} skipped={len(skipped)} "
                f"in {time.monotonic() - t0:.0f} s" + (f"  FAILED: {', '.join(bad)}" if bad else ""),
                flush=True,
            )
            if a.stop and (bad or rc not in (0, 5)):
                break
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        stop(loops)
    print(f"\n{len(counts)} tests, {time.monotonic() - t_all:.0f} s with {a.busy} busy loops:")
    for tid, c in sorted(counts.items()):
        n = f"{c['passed']:3d} passed {c['failed']:3d} failed {c['skipped']:3d} skipped"
        print(f"  {n}  max {c['max_s']:6.1f} s  {tid}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"busy": a.busy, "rounds": a.rounds, "tests": counts}, f, indent=1)
    return 1 if failed_rounds or any(c["failed"] for c in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
