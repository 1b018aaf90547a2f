"""Process-group setup from a launcher's environment, FSDP2 sharding, small collectives.

The launch contract is torchrun's: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. srun wrappers and the
supervisor's local launcher set the same variables. With none of them set the trainer
is one process: it still builds a one-rank process group (in memory, no port) so that
FSDP2 and distributed checkpointing take the same code path at every scale.

Gloo binds to the address this host's name resolves to, which on many clusters is a
loopback or management address the other nodes cannot reach (the rendezvous works and
the first collective then hangs). Unless ``GLOO_SOCKET_IFNAME`` says otherwise, the
trainer gives gloo the interface its route to ``MASTER_ADDR`` leaves by.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from wire.errors import ConfigError, UsageError
from wire.routes import route_source

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")


@dataclass(frozen=True, slots=True)
class LaunchEnv:
    """Who this process is, as the launcher's environment variables say."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launched: bool  # False: no launcher variables, a lone process

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> LaunchEnv:
        present = [name for name in _LAUNCH_VARS if name in environ]
        if not present:
            return cls(rank=0, world_size=1, local_rank=0, local_world_size=1, launched=False)
        required = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        missing = [name for name in required if name not in environ]
        if missing:
            raise UsageError(f"launcher environment incomplete: {', '.join(present)} set "
                             f"but {', '.join(missing)} missing")
        values: dict[str, int] = {}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
            raw = environ.get(name)
            if raw is None:
                continue
            try:
                values[name] = int(raw)
            except ValueError:
                raise UsageError(f"{name}: expected an integer, got {raw!r}") from None
        rank, world = values["RANK"], values["WORLD_SIZE"]
        if world < 1 or not 0 <= rank < world:
            raise UsageError(f"RANK {rank} is not within WORLD_SIZE {world}")
        return cls(rank=rank, world_size=world, local_rank=values.get("LOCAL_RANK", rank),
                   local_world_size=values.get("LOCAL_WORLD_SIZE", world), launched=True)


@dataclass(frozen=True, slots=True)
class DistContext:
    """The initialized process group, as the train loop sees it."""

    launch: LaunchEnv
    device: torch.device
    mesh: DeviceMesh

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def is_main(self) -> bool:
        return self.launch.rank == 0


def pick_device(requested: str, launch: LaunchEnv) -> torch.device:
    """``auto`` means the local GPU if there is one, else the CPU."""
    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise ConfigError("device: 'cuda' requested but no CUDA device is available")
    if requested == "cpu" or not has_cuda:
        return torch.device("cpu")
    if launch.local_rank >= torch.cuda.device_count():
        raise UsageError(f"LOCAL_RANK {launch.local_rank} but only "
                         f"{torch.cuda.device_count()} CUDA devices")
    return torch.device("cuda", launch.local_rank)


def init(launch: LaunchEnv, device_request: str, timeout_s: float) -> DistContext:
    """Create the default process group and a 1-D device mesh over all ranks."""
    device = pick_device(device_request, launch)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Several ranks share one host's cores; one intra-op thread each avoids
        # oversubscription (a 4-rank CPU run on 2 cores is 10x slower without this).
        torch.set_num_threads(1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # gloo for CPU tensors (also used by checkpoint metadata exchange), NCCL for GPU ones.
    backend = "gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl"
    timeout = timedelta(seconds=timeout_s)
    if launch.launched:
        if "GLOO_SOCKET_IFNAME" not in os.environ:
            ifname = interface_towards(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
            if ifname is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = ifname
        dist.init_process_group(backend=backend, rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout)
    else:
        store = dist.HashStore()  # type: ignore[attr-defined]  # in memory, one process
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1,
                                timeout=timeout)
    mesh = init_device_mesh(device.type, (launch.world_size,))
    return DistContext(launch=launch, device=device, mesh=mesh)


_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_towards(host: str, port: int) -> str | None:
    """The name of the interface this host reaches ``host`` by (None: loopback, or unknown)."""
    local = route_source(host, port)
    if local is None or ipaddress.ip_address(local).is_loopback:
        return None
    for _, name in socket.if_nameindex():
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            request = struct.pack("256s", name.encode()[:15])
            if socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)[20:24]) == local:
                return name
    return None


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shard_model(model: nn.Module, mesh: DeviceMesh, compute_dtype: torch.dtype) -> None:
    """FSDP2: each transformer block is one all-gather unit, the rest (embedding, final
    norm, output head) belongs to the root. Parameters stay float32 (the master copy);
    under bfloat16 only the forward/backward runs in bf16, gradients reduce in float32.
    """
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layers = model.get_submodule("layers")
    assert isinstance(layers, nn.ModuleList)
    for block in layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient reduce-scatter on all but the last micro-batch of a step."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(enabled)


def global_sums(values: list[torch.Tensor | float], device: torch.device) -> list[float]:
    """Each scalar summed over all ranks, in one all-reduce (which also syncs the device).
    Flags summed this way (a checkpoint asked for by a signal on some rank) reach every
    rank at the same step, as every collective in acting on them needs."""
    stacked = torch.stack([v.detach().float().reshape(()).to(device) if isinstance(v, torch.Tensor)
                           else torch.tensor(float(v), device=device) for v in values])
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
    return [float(x) for x in stacked.tolist()]


def local_square_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of this rank's part of ``tensors`` (a DTensor's local shard):
    summed over ranks it is the global squared L2 norm, each element counted once."""
    total = torch.zeros((), dtype=torch.float32, device=tensors[0].device if tensors else None)
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.detach().float().pow(2).sum()
    return total


def to_float(value: torch.Tensor) -> float:
    """A scalar tensor or DTensor as a Python float (collective for a sharded DTensor)."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return float(value.item())


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (pickled; meant for small decisions)."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled; meant for small lists and maps)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Any = None) -> None:
    dist.barrier(group=group)


def background_group() -> Any:
    """A second gloo group over all ranks, for a background thread's collectives (an
    asynchronous save) beside the training thread's on the default group. Every rank
    must create it, in the same order."""
    return dist.new_group(backend="gloo")
