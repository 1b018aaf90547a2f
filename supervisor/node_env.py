"""The environment a run's steps get for the nodes' accelerators (``[resources] accelerator``).

Every rank (or, with ``launch = "node"``, every node's torchrun or ``train.sh``) gets
these variables through srun's environment; a ``[command]``'s own ``env`` wins over
them, and a script that exports its own wins over both.

- ``neuron`` (trn1/trn2, EFA): as the reference trainer's Neuron backend defines it
  (wire/neuron_launch.py): the runtime's and compiler's settings seed 004 gives for
  transformer training; libfabric on EFA and bounded malloc arenas, this project's.
- ``nvidia`` (p4d/p5, EFA): seed 002's NCCL_DEBUG=INFO; the rest this project's, each
  with its reason beside it.

Each value says where it comes from: a seed document (../shared/seeds/, named), or this
project's choice and why.
"""

from __future__ import annotations

from typing import Literal

from wire.neuron_launch import NODE_ENV as NEURON_NODE_ENV

Accelerator = Literal["neuron", "nvidia"]

NVIDIA_EFA_ENV = {
    # Seed 002 (the FSDP test case): "we prefer to use NCCL_DEBUG=INFO for verbose logging"
    # (the transport NCCL chose, and the evidence when a collective fails).
    "NCCL_DEBUG": "INFO",
    # This project's choices, no seed gives them:
    "FI_PROVIDER": "efa",  # NCCL over libfabric's EFA provider, never a fallback to TCP
    "FI_EFA_USE_HUGE_PAGE": "0",  # a forked data-loader worker could not allocate huge pages
    "FI_EFA_SET_CUDA_SYNC_MEMOPS": "0",  # CUDA memory operations left unsynchronized (throughput)
    "NCCL_SOCKET_IFNAME": "^docker,lo,veth",  # NCCL's own sockets away from bridges and loopback
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed collective ends the process, not hangs it
    "LOGLEVEL": "INFO",  # torchrun's agent logs which worker failed, with its exit code
}


def accelerator_env(accelerator: Accelerator | None) -> dict[str, str]:
    if accelerator == "neuron":
        return dict(NEURON_NODE_ENV)
    if accelerator == "nvidia":
        return dict(NVIDIA_EFA_ENV)
    return {}
