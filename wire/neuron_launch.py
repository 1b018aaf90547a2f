"""How the Neuron backend is started on trn1.32xlarge nodes (pure: argv lists and env).

One torchrun per node spawns a rank per NeuronCore (32 on trn1.32xlarge: 16 Trainium
chips of 2 cores each). By hand, on node K of N (the supervisor does the same through
``srun``; see supervisor/runfiles/trainer_cmd.py)::

    <NODE_ENV> torchrun --nproc_per_node=32 --nnodes=N --node_rank=K \
        --master_addr=<node 0> --master_port=<port> -m trainer --config FILE --resume auto

``neuron_parallel_compile`` in front of the same line is the optional precompile pass:
it runs the trainer with ``NEURON_EXTRACT_GRAPHS_ONLY=1`` (the trainer then runs
``EXTRACT_GRAPHS_STEPS`` steps and saves nothing), then compiles every graph it traced
in parallel into the compile cache, so that the real run finds them compiled.

The environment (``NODE_ENV``): the runtime's and compiler's settings for transformer
training that seed 004 (HLAT) gives, and this project's own choices, each with its
reason: libfabric on the EFA devices, a bound on glibc's malloc arenas. Precision is the
trainer's own (``precision_env``).
"""

from __future__ import annotations

from collections.abc import Sequence

TRN1_32XLARGE_RANKS = 32  # NeuronCores of a trn1.32xlarge, one rank each
# The run directory's copy of the compile cache, which every node syncs with before an
# attempt (node/compile_cache.py): its name, which the daemon gives the node wrapper.
SHARED_COMPILE_CACHE_DIR = "neuron-compile-cache"
EXTRACT_GRAPHS_STEPS = 10  # steps a precompile pass traces: the first steps' graphs differ

# Where a value comes from: a seed document (../shared/seeds/, named), or this project's
# own choice with its reason. (OMP_NUM_THREADS=1, which seeds 000 and 003 export before
# `srun ./train.sh`, every Slurm step gets anyway: supervisor/slurm/requests.py.)
NODE_ENV = {
    # Seed 004 (HLAT, Llama 2 7B on 128 trn1.32xlarge): the compiler flags for transformer
    # training that shards parameters, gradients and optimizer state across data parallel
    # ranks; the fused softmax; 3 executions queued ahead of the host (latency).
    "NEURON_CC_FLAGS": "--model-type=transformer --distribution-strategy=llm-training",
    "NEURON_FUSE_SOFTMAX": "1",
    "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": "3",
    # This project's choices, no seed gives them:
    "FI_PROVIDER": "efa",  # the nodes' collectives over EFA, never a fallback to TCP sockets
    "FI_EFA_USE_DEVICE_RDMA": "1",  # RDMA straight from device memory (trn1 supports it)
    "FI_EFA_FORK_SAFE": "1",  # ranks fork (data workers, the compiler) with memory registered
    "MALLOC_ARENA_MAX": "128",  # 32 ranks' default malloc arenas can exhaust the host's memory
}


def precision_env(dtype: str) -> dict[str, str]:
    """What the trainer sets before torch-xla starts: bfloat16 ("auto" on Neuron) stores
    float32 tensors as bfloat16 on the device (XLA_DOWNCAST_BF16: this project's choice,
    torch-xla's way to train in bfloat16 without casting the model; no seed names it), the
    optimizer's state included: unlike the torch backend, there are no float32 master
    weights (NxD's master-weights option is not used)."""
    return {"XLA_DOWNCAST_BF16": "1"} if dtype in ("auto", "bfloat16") else {}


def trainer_program(config_path: str, resume: str) -> list[str]:
    """torchrun's part of the command line that runs the reference trainer."""
    return ["-m", "trainer", "--config", config_path, "--resume", resume]


def torchrun_argv(*, nnodes: int | str, master_addr: str, master_port: int | str, program: Sequence[str],
                  node_rank: int | None = None, nproc_per_node: int | str = TRN1_32XLARGE_RANKS,
                  torchrun: str = "torchrun") -> list[str]:
    """One node's torchrun, with a static rendezvous at ``master_addr:master_port`` as in
    the seeds' train.sh. ``node_rank`` None leaves it to torchrun's ``PET_NODE_RANK``
    (the supervisor's per-node wrapper sets it from ``SLURM_NODEID``), so that the same
    line runs on every node."""
    argv = [torchrun, f"--nproc_per_node={nproc_per_node}", f"--nnodes={nnodes}"]
    if node_rank is not None:
        argv.append(f"--node_rank={node_rank}")
    return [*argv, f"--master_addr={master_addr}", f"--master_port={master_port}", *program]


def precompile_argv(launch: Sequence[str]) -> list[str]:
    """The precompile pass of a torchrun line."""
    return ["neuron_parallel_compile", *launch]
