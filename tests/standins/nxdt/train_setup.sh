#!/usr/bin/env bash
# A stand-in for NxD Training's examples/train_setup.sh (Neuron SDK 2.26), its Slurm and
# single-node branches (not the one for MPI on EKS). It differs in four places, each for
# the test box: no `sudo sysctl` (the port reservation) and no
# `lctl` (FSx for Lustre); the nodes' addresses from Slurm's NodeAddr, where the real one
# asks nslookup (the box's nodes have no names in DNS); the open files' limit raised as
# far as the box allows, where the real one asks for 65535 (a container's hard limit may
# be lower, and `set -e` would end the job there).

set -o pipefail
set -e

ulimit -n 65535 2>/dev/null || ulimit -n "$(ulimit -Hn)"

if [ -v SLURM_NNODES ]
then
    # SLURM runs
    export FI_EFA_USE_DEVICE_RDMA=1
    export FI_PROVIDER=efa
    export FI_EFA_FORK_SAFE=1
    IPS=""
    for h in $(scontrol show hostname); do
        IPS="$IPS $(scontrol show node $h | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')";
    done
    HOSTS=(${IPS//\ / })
    NODEID=$SLURM_NODEID
    NTASKS=$SLURM_NTASKS

    export NEMO_EXPM_VERSION=$SLURM_JOB_ID
    export EXPLICIT_LOGDIR=null
    : ${SLURM_RESTART_COUNT:=0}
    LOG_PATH=logs/$SLURM_JOB_ID/$SLURM_RESTART_COUNT/$NODEID/
    mkdir -p $LOG_PATH
    # Make sure to install latest runtime
    # ./setup.sh   2>&1  | tee  $LOG_PATH/setup.log
else
    # Single-node, non-SLURM runs
    HOSTS=(localhost)
    NODEID=0
    NTASKS=1
    export NEMO_EXPM_VERSION=$(date "+%Y-%m-%d_%H-%M-%S")
    export EXPLICIT_LOGDIR=null
    LOG_PATH=./nemo_experiments/logs
    mkdir -p $LOG_PATH
fi

# Note: This is a temp fix till we handle functionalization
# In PT2.1, functionalization is needed to close 3% convergence gap compared to PT1.13 for ZeRO1
export XLA_DISABLE_FUNCTIONALIZATION=0

export HYDRA_FULL_ERROR=1
export MASTER_ADDR=${HOSTS[0]}
export MASTER_PORT=41000
export MALLOC_ARENA_MAX=128
export CREATE_TB_LOGGER=True
export CHECKPOINT_CALLBACK=True
