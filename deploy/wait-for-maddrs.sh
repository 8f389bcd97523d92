#!/usr/bin/env bash
# Wait for the coordinator's multiaddrs, then run a peer command bootstrapped through them.
#
#   wait-for-maddrs.sh MADDRS_FILE [--] heterorl peer --role sampler --state-dir /data/peer ...
#
# MADDRS_FILE is the coordinator's STATE_DIR/maddrs.txt (one multiaddr a line, written when it starts).
# The command runs (exec, so it gets SIGTERM directly) with `--bootstrap ADDR...` appended, and with
# `--run-key HEX` appended too when HETERORL_RUN_KEY_FILE names a non-empty file (the coordinator's public
# key, pinned instead of trusted on first use).
#
# Environment:
#   HETERORL_WAIT_TIMEOUT   seconds to wait for a usable address (default 300; 0 waits forever)
#   HETERORL_RUN_KEY_FILE   file holding the coordinator's public key in hex (optional)
#   HETERORL_KEEP_LOOPBACK  1 keeps /ip4/127.x and /ip6/::1 addresses (dropped by default: inside another
#                           container they point at itself)
set -euo pipefail

usage() {
    echo "usage: $0 MADDRS_FILE [--] COMMAND [ARG...]" >&2
    exit 2
}

[ "$#" -ge 2 ] || usage
file=$1
shift
if [ "$1" = "--" ]; then
    shift
fi
[ "$#" -ge 1 ] || usage

timeout=${HETERORL_WAIT_TIMEOUT:-300}
case $timeout in
    '' | *[!0-9]*)
        echo "$0: HETERORL_WAIT_TIMEOUT must be a whole number of seconds, not '$timeout'" >&2
        exit 2
        ;;
esac

read_addrs() {
    addrs=()
    [ -s "$file" ] || return 0
    local line
    while IFS= read -r line || [ -n "$line" ]; do
        line=${line%%#*}
        line=${line//[[:space:]]/}
        case $line in
            /*/p2p/?*) ;;
            *) continue ;; # not a complete /.../p2p/PEER_ID address
        esac
        if [ "${HETERORL_KEEP_LOOPBACK:-0}" != 1 ]; then
            case $line in
                /ip4/127.* | /ip6/::1/*) continue ;;
            esac
        fi
        addrs+=("$line")
    done < "$file"
}

start=$SECONDS
said=0
while :; do
    read_addrs
    if [ "${#addrs[@]}" -gt 0 ]; then
        # Read it again a moment later and go on only if it did not change: never a half-written file.
        first="${addrs[*]}"
        sleep 1
        read_addrs
        [ "${addrs[*]}" != "$first" ] || break
        continue
    fi
    if [ "$timeout" -gt 0 ] && [ $((SECONDS - start)) -ge "$timeout" ]; then
        echo "$0: no usable multiaddr in $file after ${timeout}s (is the coordinator running?)" >&2
        exit 1
    fi
    if [ "$said" = 0 ]; then
        echo "waiting for the coordinator's multiaddrs in $file ..." >&2
        said=1
    fi
    sleep 1
done

extra=(--bootstrap "${addrs[@]}")
key_file=${HETERORL_RUN_KEY_FILE:-}
if [ -n "$key_file" ] && [ -s "$key_file" ]; then
    run_key=$(tr -d '[:space:]' < "$key_file")
    extra+=(--run-key "$run_key")
fi
echo "bootstrapping through: ${addrs[*]}" >&2
exec "$@" "${extra[@]}"
