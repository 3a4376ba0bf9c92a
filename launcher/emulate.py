#!/usr/bin/env python
"""Stand-alone entry to the one-host cluster emulation (the library is dilocox.launch).

    launcher/emulate.py launch --replicas 2 --nproc-per-replica 2 --bandwidth 100mbit CONFIG [--a.b=v ...]
    launcher/emulate.py up --replicas 2 --bandwidth 100mbit     # namespaces until Ctrl-C, to poke at
    launcher/emulate.py cleanup                                  # remove namespaces of dead runs

``launch`` is ``dilocox launch``. ``up`` prints the namespaces, addresses and interfaces, e.g.
``ip netns exec <ns> iperf3 -s``; everything is removed on Ctrl-C/SIGTERM. Needs root.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dilocox.launch.emulate import Cluster, cleanup_stale, launch_main  # noqa: E402
from dilocox.plan import fmt_bandwidth, parse_bandwidth  # noqa: E402


def up(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="emulate.py up")
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--bandwidth", default=None, help="per replica, each way: 100mbit, 1gbit, ...")
    args = ap.parse_args(argv)
    bps = parse_bandwidth(args.bandwidth) if args.bandwidth else None
    with Cluster(args.replicas, None if bps is None else bps / 1e6) as c:
        print(f"{args.replicas} emulated clusters, cap {fmt_bandwidth(bps) if bps else 'none'} each way:")
        for r in range(args.replicas):
            print(f"  replica {r}: ip netns exec {c.ns(r)} ...   address {c.addr(r)}   interface {c.ifname(r)}")
        print("Ctrl-C removes everything.", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("launch", "up", "cleanup"):
        print(__doc__)
        return 2
    if argv[0] == "launch":
        return launch_main(argv[1:])
    if argv[0] == "up":
        return up(argv[1:])
    removed = cleanup_stale()
    print(f"removed {len(removed)} stale namespaces" + (f": {' '.join(removed)}" if removed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
