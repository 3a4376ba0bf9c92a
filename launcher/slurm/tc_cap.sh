#!/usr/bin/env bash
# Cap a node's outgoing bandwidth with tc tbf, as the DiLoCoX paper did ("1 Gbps via tc").
#
#   tc_cap.sh IFACE RATE [DEST_CIDR ...]   cap egress on IFACE to RATE (tbf); with destinations,
#                                          only traffic to them (the other clusters) is capped (htb
#                                          class + u32 filters; the rest passes unshaped)
#   tc_cap.sh IFACE --remove               remove whatever root qdisc this script installed
#   tc_cap.sh IFACE --show                 print the qdiscs and filters on IFACE
#
# RATE: 100mbit, 1gbit, 10Gbit/s or 1Gbps (all bits per second; note tc itself reads "mbps" as
# megaBYTES, so the rate is converted to plain bit/s here); a bare number is bit/s, and refused below 1000.
# Applying a cap again replaces the one there. Needs root (CAP_NET_ADMIN).
# tc shapes kernel TCP/IP traffic only: InfiniBand/RoCE RDMA (NCCL over IB) bypasses it.
set -euo pipefail

die() { echo "tc_cap.sh: $*" >&2; exit 1; }
[[ $# -ge 2 ]] || die "usage: tc_cap.sh IFACE RATE [DEST_CIDR ...] | IFACE --remove | IFACE --show"
IFACE=$1
ACTION=$2
shift 2
command -v tc >/dev/null || die "tc (iproute2) not found"
[[ -e /sys/class/net/$IFACE ]] || die "no network interface '$IFACE' here (see: ip -br link)"

case "$ACTION" in
  --remove)
    tc qdisc del dev "$IFACE" root 2>/dev/null || true
    echo "tc_cap.sh: removed the root qdisc of $IFACE"
    exit 0 ;;
  --show)
    tc qdisc show dev "$IFACE"
    tc filter show dev "$IFACE"
    exit 0 ;;
esac

# "1Gbit/s" -> 1000000000 (bits per second); k/m/g/t are decimal prefixes.
BITS=$(echo "$ACTION" | awk '{
  s = tolower($0); sub(/\/s$/, "", s)
  if (match(s, /^[0-9]*\.?[0-9]+/) == 0) exit 1
  num = substr(s, 1, RLENGTH); unit = substr(s, RLENGTH + 1)
  mult["bit"] = 1; mult["bps"] = 1; mult[""] = 1
  mult["kbit"] = 1e3; mult["kbps"] = 1e3; mult["mbit"] = 1e6; mult["mbps"] = 1e6
  mult["gbit"] = 1e9; mult["gbps"] = 1e9; mult["tbit"] = 1e12; mult["tbps"] = 1e12
  if (!(unit in mult) || num + 0 <= 0) exit 1
  if (unit == "" && num + 0 < 1000) exit 1   # "100" would be 100 bit/s: a unit is wanted (as dilocox --bandwidth)
  printf "%.0f\n", num * mult[unit] }') || die "rate '$ACTION' is not like 100mbit, 1gbit, 10Gbit/s"
# burst: at least 64 KiB (a GSO segment), else 2 ms at the rate; queue bounded at 100 ms
BURST=$(awk -v b="$BITS" 'BEGIN { x = b / 8 * 0.002; if (x < 65536) x = 65536; printf "%.0f\n", x }')
TBF=(tbf rate "${BITS}bit" burst "$BURST" latency 100ms)

if [[ $# -eq 0 ]]; then
  tc qdisc replace dev "$IFACE" root "${TBF[@]}"
  echo "tc_cap.sh: $IFACE egress capped at $BITS bit/s (all traffic)"
else
  # htb: traffic the filters do not match is "direct" (default 0: unshaped); matches go to 1:10. A root htb left by
  # an earlier cap (a job killed hard) cannot be "replaced" by another (class and filters exist): remove it first.
  tc qdisc del dev "$IFACE" root 2>/dev/null || true
  tc qdisc add dev "$IFACE" root handle 1: htb default 0
  tc class add dev "$IFACE" parent 1: classid 1:10 htb rate "${BITS}bit" ceil "${BITS}bit" burst "$BURST" quantum 60000
  for dest in "$@"; do
    tc filter add dev "$IFACE" parent 1: protocol ip prio 1 u32 match ip dst "$dest" flowid 1:10
  done
  echo "tc_cap.sh: $IFACE egress to $* capped at $BITS bit/s"
fi
