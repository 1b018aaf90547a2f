"""The environment a run's steps get for the nodes' accelerators (``[resources] accelerator``).

Every rank (or, with ``launch = "node"``, every node's torchrun or ``train.sh``) gets
these variables through srun's environment; a ``[command]``'s own ``env`` wins over
them, and a script that exports its own wins over both.

- ``neuron`` (trn1/trn2, EFA): the seeds' NxD settings, as the reference trainer's
  Neuron backend defines them (trainer/neuron/launch.py: libfabric on EFA, the Neuron
  runtime's and compiler's settings for transformer training, malloc arenas bounded).
- ``nvidia`` (p4d/p5, EFA): the FSDP test case's: NCCL over libfabric's EFA provider,
  huge pages off (a forked data-loader worker could not allocate them), CUDA memory
  operations left unsynchronized (FSDP's throughput), NCCL's own sockets away from
  container bridges and loopback, NCCL's INFO lines in the rank logs (the transport it
  chose, and the evidence when a collective fails), and a failed collective ending the
  process instead of hanging it.
"""

from __future__ import annotations

from typing import Literal

from trainer.neuron.launch import NODE_ENV as NEURON_NODE_ENV

Accelerator = Literal["neuron", "nvidia"]

NVIDIA_EFA_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_HUGE_PAGE": "0",
    "FI_EFA_SET_CUDA_SYNC_MEMOPS": "0",
    "NCCL_SOCKET_IFNAME": "^docker,lo,veth",
    "NCCL_DEBUG": "INFO",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "LOGLEVEL": "INFO",  # torchrun's agent logs which worker failed, with its exit code
}


def accelerator_env(accelerator: Accelerator | None) -> dict[str, str]:
    if accelerator == "neuron":
        return dict(NEURON_NODE_ENV)
    if accelerator == "nvidia":
        return dict(NVIDIA_EFA_ENV)
    return {}
