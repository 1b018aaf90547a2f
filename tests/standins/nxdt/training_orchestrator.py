"""A stand-in for NxD Training's examples/training_orchestrator.py, in what a supervisor
sees of it and nothing of the supervisor's: started by train.sh's torchrun with Hydra's
arguments (``--config-path=conf --config-name=NAME key=value ...``), it trains a tiny
model with its gradients all-reduced over gloo, and prints and saves as NxD Training does:

- the training progress bar of PyTorch Lightning, printed by Lightning's own ``Tqdm`` class:
  with ``standin.progress_bar = lightning2`` (NxD Training 2.x) Lightning's bar format
  (``{rate_noinv_fmt}``, it/s) and NxD Training's postfix, in its order (``v_num``, then
  reduced_train_loss, lr, parameter_norm and gradient_norm where the config logs them,
  global_step as the float of the step in progress, consumed_samples, throughput,
  throughput_peak), its numbers formatted by Lightning (``global_step=2e+3``); with
  ``tqdm-default`` the tutorial's llama.out lines, tqdm's own format (s/it) without a
  postfix. A bar per epoch of ``data.batches_per_epoch`` batches, redrawn with ``\\r``;
- exp_manager's directories: ``nemo_experiments/<name>/<$NEMO_EXPM_VERSION>/checkpoints/``
  (``exp_manager.checkpoint_callback_params.dirpath`` instead, when the config sets it),
  a save every ``every_n_train_steps`` named from the config's ``filename``
  (``hf_llama3_70B--step=10-consumed_samples=80.0.ckpt``, a directory: NxD's checkpoint
  IO), made as NeMo and NxD make it: a ``<name>-unfinished`` marker beside it first, then
  its ``checkpoint`` tag, then every rank its own shard of ``model/`` and ``optim/``
  (``dp_rank_NN_tp_rank_00_pp_rank_00.pt``), then ``done``, then the marker removed;
  ``save_top_k = 1`` deletes the older save once the newer is done. A rank killed while
  the others write leaves a torn save;
- ``resume_if_exists``: NxD Training's ``check_resume``: the newest ``*.ckpt`` below its
  own checkpoint directory by modification time, with no check that it is complete (a
  torn one fails to load: keeping it out of the way is the supervisor's job), and
  training from scratch when there is none (``resume_ignore_no_checkpoint``): a new Slurm
  job id is a new version directory, with nothing in it;
- the Neuron compiler's lines: a step graph not in the node's ``$NEURON_COMPILE_CACHE_URL``
  (``compiler_cache_url`` when the variable is unset, as NxD Training does) is compiled
  first by the node's local rank 0 (``||NEURON_CC_WRAPPER||: Call compiler``,
  ``standin.compile_s``: one such line is one graph compiled on that node); under
  neuron_parallel_compile's trial run (``NEURON_EXTRACT_GRAPHS_ONLY=1``) its graph is
  extracted into the cache's ``extracted/`` instead, nothing real is computed (the loss
  prints 0 and the weights it saves are zeros, as a trial run's outputs are to be
  ignored), and it stops after ``standin.trial_steps`` steps.

Each step's data is drawn from the step number and the rank, so a resumed run sees the
batches a run that never failed would: ``$STANDIN_FINAL_WEIGHTS`` (a path; not NxD
Training's) gets the final weights from rank 0.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml


def load_config(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """Hydra's way in: the config named by --config-path/--config-name, then key=value."""
    opts = dict(a.removeprefix("--").split("=", 1) for a in argv if a.startswith("--config-"))
    name = opts["config-name"]
    path = Path(opts.get("config-path", "conf")) / f"{name}.yaml"
    if not path.is_file():
        sys.exit(f"hydra.errors.MissingConfigException: Cannot find primary config '{name}'. "
                 "Check that it's in your config search path.")
    config = yaml.safe_load(path.read_text())
    for arg in argv:
        if arg.startswith("--") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value) if value else None
    return name, config


class Bar:
    """Lightning's training progress bar, one per epoch, on rank 0."""

    def __init__(self, style: str, total: int) -> None:
        from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, TQDMProgressBar
        self.tqdm, self.style, self.total = Tqdm, style, total
        self.format = TQDMProgressBar.BAR_FORMAT if style == "lightning2" else None
        self.bar: Any = None
        self.epoch = -1

    def show(self, step: int, metrics: dict[str, float | str]) -> None:
        epoch, n = divmod(step - 1, self.total)
        if epoch != self.epoch:
            if self.bar is not None:
                self.bar.close()
            kw = {"bar_format": self.format} if self.format else {}
            self.bar = self.tqdm(desc=f"Epoch {epoch}", total=self.total, leave=True, dynamic_ncols=True,
                                 file=sys.stdout, smoothing=0, **kw)
            self.epoch = epoch
        self.bar.n = n + 1
        if self.style == "lightning2":
            self.bar.set_postfix(metrics, refresh=False)
        self.bar.refresh()


def checkpoint_name(template: str, step: int, consumed: float) -> str:
    """Lightning's ModelCheckpoint.format_checkpoint_name: "{step}" -> "step=10"."""
    return template.replace("{step}", f"step={step}").replace("{consumed_samples}", f"consumed_samples={consumed}")


def check_resume(directory: Path) -> tuple[int, Path] | None:
    """NxD Training's check_resume: the newest ``*.ckpt`` below ``directory`` by
    modification time, complete or not; None when there is none (training from scratch)."""
    found = sorted(directory.rglob("*.ckpt"), key=os.path.getmtime, reverse=True) if directory.is_dir() else []
    if not found:
        return None
    m = re.search(r"step=(\d+)", found[0].name)
    return (int(m.group(1)) if m else 0), found[0]


def shard_name(rank: int) -> str:
    return f"dp_rank_{rank:02d}_tp_rank_00_pp_rank_00.pt"


def save(directory: Path, name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int,
         top_k: int) -> None:
    """As NxD saves: rank 0 marks the save unfinished, every rank writes its own shard,
    then rank 0 marks it done and removes the marker."""
    rank = dist.get_rank()
    path = directory / f"{name}.ckpt"
    marker = directory / f"{name}-unfinished"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        marker.touch()
        path.mkdir(exist_ok=True)
        (path / "checkpoint").write_text(f"{step}\n")
        for part in ("model", "optim"):
            (path / part).mkdir(exist_ok=True)
    dist.barrier()
    for part, state in (("model", model.state_dict()), ("optim", opt.state_dict())):
        torch.save({"state": state, "step": step}, path / part / shard_name(rank))
    dist.barrier()
    if rank == 0:
        (path / "done").touch()
        marker.unlink()
        saves = sorted((int(m.group(1)), p) for p in directory.glob("*.ckpt")
                       if (m := re.search(r"step=(\d+)", p.name)) and (p / "done").exists())
        for _, old in saves[:-top_k]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def compile_graph(cache: Path, graph: str, extract: bool, compile_s: float) -> None:
    """Each node compiles into its own cache: its local rank 0 does, the others wait."""
    local0 = os.environ.get("LOCAL_RANK", "0") == "0"
    if extract:
        if local0:
            (cache / "extracted").mkdir(parents=True, exist_ok=True)
            (cache / "extracted" / graph).touch()
            print(f"||NEURON_CC_WRAPPER||: Extracting graphs ({graph}) for ahead-of-time parallel compilation. "
                  "No compilation was done.", flush=True)
    elif local0 and not (cache / f"{graph}.neff").exists():
        print(f"||NEURON_CC_WRAPPER||: Call compiler on {graph}", flush=True)
        time.sleep(compile_s)
        cache.mkdir(parents=True, exist_ok=True)
        (cache / f"{graph}.neff").write_text(f"compiled {graph}\n")
        print(f"Compiler status PASS: {graph}", flush=True)
    dist.barrier()


def main() -> None:
    name, cfg = load_config(sys.argv[1:])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer, exp, data, standin = cfg["trainer"], cfg["exp_manager"], cfg["data"], cfg["standin"]
    ck_params = exp["checkpoint_callback_params"]
    extract = os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY") == "1"
    os.environ.setdefault("NEURON_COMPILE_CACHE_URL", cfg["compiler_cache_url"])  # as training_orchestrator.py
    cache = Path(os.environ["NEURON_COMPILE_CACHE_URL"])
    log_dir = Path(exp["explicit_log_dir"] or Path("nemo_experiments") / exp["name"]
                   / os.environ.get("NEMO_EXPM_VERSION", "0"))
    ck_dir = Path(ck_params.get("dirpath") or log_dir / "checkpoints")

    torch.manual_seed(cfg["seed"])
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    found = check_resume(ck_dir) if exp.get("resume_if_exists") else None
    if found is None and rank == 0 and exp.get("resume_if_exists"):
        print(f"There were no checkpoints found in {ck_dir}. Training from scratch.", flush=True)
    if found is not None:
        start, path = found
        if rank == 0:  # exp_manager's line, then Lightning's
            print(f"Resuming from {path}", flush=True)
            print(f"Restoring states from the checkpoint path at {path}", flush=True)
        model.load_state_dict(torch.load(path / "model" / shard_name(rank))["state"])
        opt.load_state_dict(torch.load(path / "optim" / shard_name(rank))["state"])
    graph = "train_step_" + hashlib.sha256(f"{name}:{world}".encode()).hexdigest()[:12]
    compile_graph(cache, graph, extract, float(standin["compile_s"]))
    if extract:  # a trial run computes nothing real: what it would save is no model
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()

    last = min(trainer["max_steps"], standin["trial_steps"]) if extract else trainer["max_steps"]
    gbs, per_rank = data["global_batch_size"], max(1, data["global_batch_size"] // world)
    bar = Bar(standin["progress_bar"], data["batches_per_epoch"]) if rank == 0 else None
    peak = 0.0
    for step in range(start + 1, last + 1):
        began = time.perf_counter()
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(per_rank, 16, generator=g)
        y = x.sum(1, keepdim=True)
        if extract:
            loss, grad_norm = torch.zeros(()), 0.0
        else:
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= world
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), trainer["gradient_clip_val"]))
            opt.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        time.sleep(float(standin["step_s"]))
        if bar is not None:
            throughput = gbs / (time.perf_counter() - began)
            peak = max(peak, throughput)
            metrics: dict[str, float | str] = {"v_num": os.environ.get("NEMO_EXPM_VERSION", "0"),
                                               "reduced_train_loss": float(reduced) / world,
                                               "lr": opt.param_groups[0]["lr"]}
            if exp.get("log_parameter_norm"):
                metrics["parameter_norm"] = math.sqrt(sum(float((p.detach() ** 2).sum()) for p in model.parameters()))
            if exp.get("log_gradient_norm"):
                metrics["gradient_norm"] = grad_norm
            metrics |= {"global_step": float(step - 1), "consumed_samples": float(step * gbs),
                        "throughput": throughput, "throughput_peak": peak}
            bar.show(step, metrics)
        if step % ck_params["every_n_train_steps"] == 0:
            save(ck_dir, checkpoint_name(ck_params["filename"], step, float(step * gbs)), model, opt, step,
                 ck_params["save_top_k"])
    if bar is not None and bar.bar is not None:
        bar.bar.close()
    out = os.environ.get("STANDIN_FINAL_WEIGHTS")
    if rank == 0 and out and not extract:
        torch.save(model.state_dict(), out)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
