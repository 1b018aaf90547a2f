#!/bin/sh
# A stand-in for NxD Training's train.sh (the HyperPod Trainium tutorial), run as
# `srun ./train.sh` with one task per node: torchrun inside, its rendezvous taken from
# Slurm's variables, the master the first host of the job's node list.
set -eu
MASTER_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# A real cluster resolves node names; the test box's nodes have no names in DNS, so the
# address Slurm knows stands in for the lookup.
MASTER_ADDR=$(getent hosts "$MASTER_HOST" | awk '{print $1}' || true)
if [ -z "$MASTER_ADDR" ]; then
    MASTER_ADDR=$(scontrol show node "$MASTER_HOST" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
fi
echo "train.sh on $SLURMD_NODENAME: node $SLURM_NODEID of $SLURM_NTASKS, master $MASTER_HOST ($MASTER_ADDR)"
exec "$TORCHRUN" --nnodes "$SLURM_NTASKS" --nproc_per_node "$PROCESSES_PER_NODE" --node_rank "$SLURM_NODEID" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$@"
