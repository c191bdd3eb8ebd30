#!/bin/bash
# Train a plan on two GPU nodes without a scheduler: run this on each node, the first node's address first.
#   node0$ examples/multinode/torchrun-2node.sh node0 eth0
#   node1$ examples/multinode/torchrun-2node.sh node0 eth0
# Both nodes must see the repository and the run folder at the same path (shared storage) and reach node0:29500.
set -euo pipefail

HEAD=${1:?first argument: the first node address (the rendezvous host)}
IFNAME=${2:?second argument: the network interface the nodes reach each other on}
PLAN=${PLAN:-examples/multinode/ladder-d768-2node-h100.yaml}

# rackcast starts torchrun itself (c10d rendezvous at HEAD:29500, 8 processes on this node, NCCL on IFNAME) ...
exec .venv/bin/rackcast train "$PLAN" --steps 200 --checkpoint-every 50 --out runs/ladder-2node \
    --nnodes 2 --nproc-per-node 8 --rdzv-endpoint "$HEAD:29500" --ifname "$IFNAME"

# ... or, the same with torchrun's own command line, each worker running rackcast under it (--launcher auto finds
# RANK and WORLD_SIZE in the environment torchrun gives it):
#   NCCL_SOCKET_IFNAME=$IFNAME GLOO_SOCKET_IFNAME=$IFNAME .venv/bin/python -m torch.distributed.run --nnodes 2 --nproc-per-node 8 \
#       --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" --rdzv-id ladder-2node --max-restarts 0 \
#       -m rackcast.cli train "$PLAN" --steps 200 --checkpoint-every 50 --out runs/ladder-2node
