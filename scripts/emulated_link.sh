#!/usr/bin/env bash
# Run a command on an emulated cluster link: a private network namespace whose loopback, the
# only interface there, is shaped by a token-bucket filter to RATE (tc's units: 2gbit, 500mbit).
#
#   scripts/emulated_link.sh RATE -- COMMAND [ARG ...]
#
# Every process of COMMAND shares the one shaped loopback: all traffic between them, in both
# directions and between every pair, passes one link of RATE (a shared segment, not one NIC
# per node). Addresses are 127.0.0.1 only; GLOO_SOCKET_IFNAME=lo makes gloo use it. Needs root
# for unshare --net and tc. Exit status: COMMAND's; 2 for a bad call; unshare's own (1) when
# the namespace cannot be made; 3 when the loopback or the filter cannot be set up in it.
set -euo pipefail

usage() {
    echo "usage: $0 RATE -- COMMAND [ARG ...]   (RATE in tc units, e.g. 2gbit, 500mbit)" >&2
    exit 2
}

[[ $# -ge 3 && $2 == "--" ]] || usage
rate=$1
shift 2

# tc's rate units and their bits per second.
declare -A bits_per_second=(
    [bit]=1 [kbit]=1e3 [mbit]=1e6 [gbit]=1e9 [tbit]=1e12
    [bps]=8 [kbps]=8e3 [mbps]=8e6 [gbps]=8e9 [tbps]=8e12
)
if [[ ! $rate =~ ^([0-9]+(\.[0-9]+)?)([a-z]+)$ ]] || [[ -z ${bits_per_second[${BASH_REMATCH[3]}]:-} ]]; then
    echo "$0: RATE: expected a number with a tc unit (bit, kbit, mbit, gbit, tbit, bps," \
        "kbps, mbps, gbps, tbps), got '$rate'" >&2
    exit 2
fi

# The bucket holds 4 ms of traffic, so the filter keeps the rate at a 250 Hz kernel timer
# without letting a long burst through, and at least two 64 KiB loopback packets, which a
# smaller bucket would drop; 100 ms of queue keeps TCP from dropping on bursts.
burst=$(awk -v number="${BASH_REMATCH[1]}" -v scale="${bits_per_second[${BASH_REMATCH[3]}]}" \
    'BEGIN { bytes = number * scale / 8 / 250; printf "%d", (bytes > 131072 ? bytes : 131072) }')

exec unshare --net -- bash -c '
    ip link set lo up && tc qdisc add dev lo root tbf rate "$1" burst "$2" latency 100ms || exit 3
    export GLOO_SOCKET_IFNAME=lo
    exec "${@:3}"
' emulated_link "$rate" "$burst" "$@"
