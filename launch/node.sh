#!/usr/bin/env bash
# Start this node's share of a multi-node job without passwordless ssh: run the same line on every
# node, each with its own NODE_RANK (0 on the master), all naming the master's address.
#
#   launch/node.sh NODE_RANK MASTER_ADDR [dsmt train arguments...]
#   e.g. on worker-1: launch/node.sh 0 10.0.0.1 --config launch/configs/multi30k_en_de.yaml \
#                       --deepspeed_config ds_configs/zero2.json
#        on worker-2: launch/node.sh 1 10.0.0.1 --config ... (the same arguments)
#
# HOSTFILE (default: ./hostfile) lists every node; MASTER_PORT defaults to 29500.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,11p' "$0" >&2
    exit 2
fi
node_rank=$1 master_addr=$2
shift 2
exec dsmt launch --hostfile "${HOSTFILE:-hostfile}" --no_ssh --node_rank="$node_rank" \
    --master_addr="$master_addr" --master_port="${MASTER_PORT:-29500}" launch/train.py "$@"
