#!/usr/bin/env bash
# Run a command on an emulated cluster link: a private network namespace whose loopback, the
# only interface there, is shaped by a token-bucket filter to RATE (tc's units: 2gbit, 500mbit).
#
#   scripts/emulated_link.sh RATE -- COMMAND [ARG ...]
#
# Every process of COMMAND shares the one shaped loopback: all traffic between them, in both
# directions and between every pair, passes one link of RATE (a shared segment, not one NIC
# per node). Addresses are 127.0.0.1 only; GLOO_SOCKET_IFNAME=lo makes gloo use it. Needs
# root (or user namespaces) for unshare --net and tc. Exit status: COMMAND's, or 2 for a bad
# call, or 3 when the namespace or the filter cannot be set up here.
set -euo pipefail

usage() {
    echo "usage: $0 RATE -- COMMAND [ARG ...]   (RATE in tc units, e.g. 2gbit, 500mbit)" >&2
    exit 2
}

[[ $# -ge 3 && $2 == "--" ]] || usage
rate=$1
shift 2
[[ $rate =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$ ]] || {
    echo "$0: RATE: expected a number with a tc unit (bit, kbit, mbit, gbit, ...), got '$rate'" >&2
    exit 2
}

# The bucket holds 4 ms of traffic, so the filter keeps the rate at a 250 Hz kernel timer
# without letting a long burst through, and at least two 64 KiB loopback packets, which a
# smaller bucket would drop; 100 ms of queue keeps TCP from dropping on bursts.
burst=$(awk -v r="$rate" 'BEGIN {
    n = r + 0; u = substr(r, length(n "") + 1)
    scale["bit"] = 1; scale["kbit"] = 1e3; scale["mbit"] = 1e6; scale["gbit"] = 1e9
    scale["tbit"] = 1e12; scale["bps"] = 8; scale["kbps"] = 8e3; scale["mbps"] = 8e6
    scale["gbps"] = 8e9; scale["tbps"] = 8e12
    bytes = n * scale[u] / 8 / 250
    printf "%d", (bytes > 131072 ? bytes : 131072)
}')
# The inner shell exits 3 when the set-up fails.
exec unshare --net -- bash -c '
    ip link set lo up && tc qdisc add dev lo root tbf rate "$0" burst "$1" latency 100ms || exit 3
    export GLOO_SOCKET_IFNAME=lo
    exec "${@:2}"
' "$rate" "$burst" "$@"
