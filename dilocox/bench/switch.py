"""``dilocox bench switch``: the delay switch's own ceiling (issue 20: it must be far above the links it emulates).

Two namespaces joined by the delay switch (``netns.Cluster(2, None, rtt_ms=...)``, no tbf cap), and the same two
joined by the kernel bridge for reference:

- TCP bulk: one stream from replica 0 to 1 (veth GSO frames up to 64 KB, forwarded whole): Gbit/s;
- UDP at MTU size: ``--senders`` processes each blast 1472-byte datagrams (1514-byte frames); frames sent (the
  sender's veth) and delivered (the receiver's veth, before its socket) per second, and Gbit/s at 1500-byte frames.

On a 2-core machine the senders, the receiver and the switch share the cores, so the UDP figure is a floor of the
switch's ceiling (the bridge row shows what the same senders reach without it).

    dilocox bench switch [--rtt-ms 0.01] [--seconds 3] [--senders 2] [--out docs/bench/switch]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

from dilocox.bench.runner import out_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RECV = textwrap.dedent("""
    import socket, sys, threading, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 5201)); s.listen(8)
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", 5301)); u.settimeout(0.5)
    seen = [0, 0.0, 0.0]  # datagrams, first, last
    def count():
        while True:
            try:
                u.recv(2048)
            except OSError:
                continue
            t = time.monotonic(); seen[0] += 1; seen[2] = t
            if seen[0] == 1: seen[1] = t
    threading.Thread(target=count, daemon=True).start()
    print("up", flush=True)
    c, _ = s.accept(); n = 0; t0 = time.monotonic()
    while True:
        d = c.recv(1 << 20)
        if not d: break
        n += len(d)
    tcp = n * 8 / (time.monotonic() - t0) / 1e9
    time.sleep(float(sys.argv[1]) + 1.5)
    dt = max(1e-9, seen[2] - seen[1])
    open(sys.argv[2], "w").write(f"{tcp} {seen[0]} {dt}")
""")

SEND_TCP = textwrap.dedent("""
    import socket, sys, time
    c = socket.create_connection((sys.argv[1], 5201), timeout=30)
    buf, end = b"b" * (1 << 20), time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end: c.sendall(buf)
    c.close()
""")

SEND_UDP = textwrap.dedent("""
    import socket, sys, time
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); d = b"x" * 1472; end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        for _ in range(256):
            try: u.sendto(d, (sys.argv[1], 5301))
            except OSError: pass
""")


def measure(rtt_ms: float | None, seconds: float, senders: int) -> dict:
    """One row: the switch (rtt_ms set) or the bridge (None)."""
    from dilocox.distributed.procs import read_ready_line
    from dilocox.launch.netns import Cluster

    with Cluster(2, None, rtt_ms=rtt_ms or 0.0) as c, tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "recv")
        recv = c.exec(1, [sys.executable, "-c", RECV, str(seconds), out], stdout=subprocess.PIPE, text=True)
        if read_ready_line(recv, r"^up$", 60.0) is None:  # (a silent receiver must not hang the bench)
            recv.kill()
            raise RuntimeError("the receiver in the second namespace did not start within 60 s")
        ns0 = ["ip", "netns", "exec", c.ns(0), sys.executable, "-c"]
        subprocess.run([*ns0, SEND_TCP, c.addr(1), str(seconds)], check=True, timeout=seconds + 60)
        tx0, rx0, t0 = c.tx_packets(0), c._stat(1, "rx_packets"), time.monotonic()
        procs = [subprocess.Popen([*ns0, SEND_UDP, c.addr(1), str(seconds)]) for _ in range(senders)]
        for p in procs:
            p.wait(timeout=seconds + 60)
        time.sleep(0.5)  # (frames still in the switch)
        sent, got, dt = c.tx_packets(0) - tx0, c._stat(1, "rx_packets") - rx0, time.monotonic() - t0 - 0.5
        recv.wait(timeout=seconds + 30)
        with open(out) as f:
            tcp, _, _ = f.read().split()
    fps = got / dt  # frames delivered to the receiver's interface (before its socket), per second
    return {
        "udp_frames_sent_per_s": sent / dt,
        "path": "delay switch" if rtt_ms else "kernel bridge",
        "rtt_ms": rtt_ms or 0.0,
        "tcp_gbit": float(tcp),
        "udp_frames_per_s": fps,
        "udp_gbit_1500B": fps * 1514 * 8 / 1e9,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dilocox bench switch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt-ms", type=float, default=0.01, help="the switch's round trip (tiny: measure its cost)")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of each transfer")
    ap.add_argument("--senders", type=int, default=2, help="UDP sender processes")
    ap.add_argument(
        "--out", type=out_dir, default=os.path.join(ROOT, "docs", "bench", "switch"), help="results.md/json go here"
    )
    a = ap.parse_args(argv)
    from dilocox.launch.netns import netns_available

    ok, why = netns_available()
    if not ok:
        print(f"dilocox bench switch: needs network namespaces: {why}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    stopped: list[int] = []

    def on_signal(signum, frame):  # (the Cluster's own handler tears the namespaces down first, then calls this)
        stopped.append(signum)
        raise KeyboardInterrupt

    prev = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        rows = [measure(None, a.seconds, a.senders), measure(a.rtt_ms, a.seconds, a.senders)]
    except (KeyboardInterrupt, RuntimeError, subprocess.SubprocessError, OSError):
        if not stopped:
            raise
        print("dilocox bench switch: interrupted; the namespaces were removed, nothing written", file=sys.stderr)
        return 128 + stopped[0]
    finally:
        for sig, h in prev.items():
            signal.signal(sig, h)
    md = markdown(rows, a, time.monotonic() - t0)
    print(md)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"rows": rows, "argv": sys.argv[1:]}, f, indent=1)
    print(f"wrote {a.out}/results.md (python -m dilocox.bench.report copies it into docs/BENCHMARKS.md)")
    return 0


def markdown(rows: list[dict], a, seconds: float) -> str:
    from dilocox.bench.runner import machine_line

    out = [
        f"Machine: {machine_line()}; {time.strftime('%Y-%m-%d')}; `dilocox bench switch --rtt-ms {a.rtt_ms:g} "
        f"--seconds {a.seconds:g} --senders {a.senders}` ({seconds:.0f} s).",
        "",
        "| path | TCP bulk (Gbit/s) | 1514-B frames sent/s | delivered/s | Gbit/s at 1500 B |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['path']} | {r['tcp_gbit']:.2f} | {r['udp_frames_sent_per_s']:,.0f} | {r['udp_frames_per_s']:,.0f} | "
            f"{r['udp_gbit_1500B']:.2f} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
