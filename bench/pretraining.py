"""Throughput and MFU of the reference trainer on the real data path.

Writes the tiny corpus and its tokenizer (trainer/corpus.py), then trains ``--model`` on
its arrow shards with ``--ranks`` local ranks (gloo on CPU, NCCL on a GPU) for
``--steps`` steps, and prints one JSON object: median tokens/s and MFU over the steps
after ``--warmup`` (from rank 0's progress lines), the loss at the first and last step,
the peak the MFU is taken against, and the wall time.

    PYTHONPATH=. python bench/pretraining.py --ranks 2 --steps 200
    PYTHONPATH=. python bench/pretraining.py --model llama3.2-1b --seq-len 2048 \\
        --global-batch 8 --micro-batch 1 --ranks 1 --dtype bfloat16 --steps 30   (one GPU)

The CPU's peak is modelled (trainer/flops.py: clock x FMA width x one thread per rank),
a GPU's is its maker's stated dense peak for the dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.ports import free_port  # noqa: E402
from trainer import flops  # noqa: E402
from trainer.corpus import write_tiny_corpus  # noqa: E402
from trainer.shapes import SHAPES  # noqa: E402

STEP = re.compile(r"^step (\d+)/\d+ loss ([0-9.]+) .*tokens_per_s (\d+) mfu ([0-9.]+|n/a)%?", re.M)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--activation-checkpointing", default="none")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pretraining-bench-") as tmp:
        corpus = write_tiny_corpus(Path(tmp) / "corpus", documents=20_000)
        overrides = "" if args.model == "tiny" else f"[model_overrides]\nvocab_size = {corpus.vocab_size}\n"
        micro = f"micro_batch_size = {args.micro_batch}\n" if args.micro_batch else ""
        config = Path(tmp) / "bench.toml"
        config.write_text(
            f'model = "{args.model}"\nsteps = {args.steps}\nglobal_batch_size = {args.global_batch}\n{micro}'
            f'seq_len = {args.seq_len}\ndtype = "{args.dtype}"\n'
            f'activation_checkpointing = "{args.activation_checkpointing}"\n'
            f'output_dir = "{tmp}/out"\n'
            f'[data]\nkind = "arrow"\npath = "{corpus.tokens}"\n'
            f'[checkpoint]\ndir = "{tmp}/ckpt"\nevery_steps = 0\n{overrides}')
        port, procs = free_port(), []
        started = time.monotonic()
        for rank in range(args.ranks):
            env = {k: v for k, v in os.environ.items() if not k.startswith("TSUP_")}
            env.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       PYTHONPATH=str(REPO))
            procs.append(subprocess.Popen([sys.executable, "-m", "trainer", "--config", str(config)], env=env,
                                          stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                          stderr=subprocess.STDOUT, text=True))
        log, _ = procs[0].communicate()
        codes = [procs[0].returncode, *(p.wait() for p in procs[1:])]
        wall = time.monotonic() - started
    if any(codes):
        sys.exit(f"trainer failed {codes}:\n{log[-3000:]}")
    steps = [(int(m[1]), float(m[2]), float(m[3]), m[4]) for m in STEP.finditer(log)]
    timed = [s for s in steps if s[0] > args.warmup]
    mfus = [float(s[3]) / 100 for s in timed if s[3] != "n/a"]
    # The trained shape: the corpus's vocabulary replaces a named shape's.
    shape = SHAPES[args.model] if args.model == "tiny" else replace(SHAPES[args.model],
                                                                    vocab_size=corpus.vocab_size)
    print(json.dumps({
        "model": args.model, "parameters": shape.parameter_count(), "ranks": args.ranks,
        "global_batch": args.global_batch, "seq_len": args.seq_len, "dtype": args.dtype,
        "activation_checkpointing": args.activation_checkpointing, "steps": args.steps,
        "tokens_per_s_median": statistics.median(s[2] for s in timed),
        "mfu_median": statistics.median(mfus) if mfus else None,
        "flops_per_token": flops.training_flops_per_token(shape, args.seq_len),
        "cpu_peak_tflops_per_rank_modelled": flops.cpu_peak_tflops(1),
        "loss_first": steps[0][1], "loss_last": steps[-1][1],
        "corpus_tokens": corpus.token_count, "wall_s": round(wall, 1),
    }, indent=2))


if __name__ == "__main__":
    main()
