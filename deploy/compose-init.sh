#!/usr/bin/env bash
# One-shot set-up for deploy/compose.yaml (its `init` service), run before the coordinator starts.
# Idempotent: keys and run.toml that exist are kept, so `docker compose up` again changes nothing.
#
#   1. creates the learner's identity key (the learner's state dir holds it as peer.key) and the
#      coordinator's key, each 0600, with `heterorl keys new`;
#   2. writes SHARED/run.toml listing the learner's public key in learner_keys (a run.toml already there is
#      kept, but it must list that key: the coordinator's RunSpec names the learners that may sign
#      checkpoints, and samplers load no checkpoint signed by anyone else);
#   3. writes SHARED/run-key.hex, the coordinator's public key, which wait-for-maddrs.sh passes to the
#      peers as --run-key (pinned rather than trusted on first use).
#
# Started as root (compose runs it so, because fresh volumes can be root-owned), it hands the volumes'
# mount points, HETERORL_VOLUMES (default: /shared /learner /coordinator), and the directories it writes to
# HETERORL_DROP_TO (default heterorl), then re-runs itself as that user.
set -euo pipefail

shared=${HETERORL_SHARED_DIR:-/shared}
learner_key=${HETERORL_LEARNER_KEY:-/learner/peer/peer.key}
coordinator_key=${HETERORL_COORDINATOR_KEY:-/coordinator/coordinator.key}
run_id=${HETERORL_RUN_ID:-compose-run}
coordinator_state=${HETERORL_COORDINATOR_STATE_DIR:-$shared/coordinator}
drop_to=${HETERORL_DROP_TO-heterorl}

read -r -a volumes <<< "${HETERORL_VOLUMES-/shared /learner /coordinator}"
dirs=("$shared" "$coordinator_state" "$(dirname "$learner_key")" "$(dirname "$coordinator_key")")

if [ "$(id -u)" = 0 ] && [ -n "$drop_to" ] && id -u "$drop_to" > /dev/null 2>&1; then
    # The volume roots first: a peer writes beside its state dir (STATE_DIR/../models), so the whole
    # volume, not only the key's directory, must belong to the peer's user.
    for d in "${volumes[@]}" "${dirs[@]}"; do
        mkdir -p "$d"
        chown "$drop_to:$(id -gn "$drop_to")" "$d"
    done
    exec setpriv --reuid="$drop_to" --regid="$(id -g "$drop_to")" --init-groups -- "$0" "$@"
fi
mkdir -p "$shared" "$coordinator_state"
umask 077
mkdir -p "$(dirname "$learner_key")" "$(dirname "$coordinator_key")"

new_key() {
    if [ ! -e "$1" ]; then
        heterorl keys new --key "$1" > /dev/null
        echo "created $1" >&2
    fi
}

public_key() {
    local out
    out=$(heterorl keys show --key "$1")
    printf '%s\n' "$out" | awk '$1 == "public" && $2 == "key:" { print $3 }'
}

new_key "$learner_key"
new_key "$coordinator_key"
learner_pub=$(public_key "$learner_key")
coordinator_pub=$(public_key "$coordinator_key")
for k in "$learner_pub" "$coordinator_pub"; do
    if ! [[ $k =~ ^[0-9a-f]{64}$ ]]; then
        echo "$0: could not read a public key from \`heterorl keys show\` (got '$k')" >&2
        exit 1
    fi
done

run_toml=$shared/run.toml
if [ -e "$run_toml" ]; then
    if ! grep -q "$learner_pub" "$run_toml"; then
        echo "$0: $run_toml does not list the learner's public key $learner_pub in learner_keys;" \
            "add it there, or delete the file to have it written again" >&2
        exit 1
    fi
    echo "keeping $run_toml" >&2
else
    umask 022
    # the one example the project keeps (heterorl coordinator --example-config), with this run's id and key
    {
        echo "# Written by deploy/compose-init.sh (keep learner_keys when you edit it). The coordinator signs its"
        echo "# RunSpec from this file at its first start and keeps it in its state dir: later edits need a fresh one."
        heterorl coordinator --example-config \
            | sed -e "s|^run_id = .*|run_id = \"$run_id\"|" -e "s|<64 hex chars>|$learner_pub|"
    } > "$run_toml.tmp"
    mv "$run_toml.tmp" "$run_toml"
    echo "wrote $run_toml" >&2
fi

umask 022
printf '%s\n' "$coordinator_pub" > "$shared/run-key.hex.tmp"
mv "$shared/run-key.hex.tmp" "$shared/run-key.hex"
echo "learner public key:     $learner_pub"
echo "coordinator public key: $coordinator_pub (pinned by the peers as --run-key)"
