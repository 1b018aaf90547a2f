"""Command line of the reference trainer; see trainer/README.md for the whole contract.

    python -m trainer --config FILE [--resume PATH|auto|none]
    python -m trainer --check-config FILE [--world-size N]
    python -m trainer --print-config FILE
    python -m trainer --standby LABEL         (trainer/standby.py)

``--check-config`` and ``--print-config`` must stay fast (the supervisor runs them on
every submit): this module imports torch only when it is about to train.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from dataclasses import asdict

from trainer.config import config_digest, config_to_dict, load_config
from wire.errors import (
    EXIT_DO_NOT_RETRY,
    EXIT_OK,
    ConfigError,
    DoNotRetry,
    exit_code_for,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Llama pre-training on torch (FSDP2) or Neuron (NxD), supervised by "
                    "training-supervisor.",
        epilog="Exit codes: 0 success, 1 unexpected error (may retry), "
               "2 configuration or usage error (do not retry).")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--config", metavar="FILE", help="train with this TOML/JSON config")
    action.add_argument("--check-config", metavar="FILE",
                        help="validate a config: prints 'ok' or one line per problem")
    action.add_argument("--print-config", metavar="FILE",
                        help="print the resolved config, model shape and digest as JSON")
    action.add_argument("--standby", metavar="LABEL",
                        help="a warm standby: import torch, then wait for an assignment (a JSON "
                             "line on stdin) and train as it says (trainer/standby.py)")
    parser.add_argument("--resume", default="auto", metavar="PATH|auto|none",
                        help="checkpoint to start from: a step_NNNNNNNN directory, 'auto' "
                             "(newest complete one in checkpoint.dir; the default) or 'none'")
    parser.add_argument("--world-size", type=int, metavar="N",
                        help="with --check-config: also check the batch split over N ranks")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # exits 2 on a usage error, like DoNotRetry
    if args.check_config:
        return _check(args.check_config, args.world_size)
    if args.print_config:
        return _print(args.print_config)
    if args.standby:
        from trainer.standby import wait

        return wait(main)
    return _train(args.config, args.resume)


def _check(path: str, world_size: int | None) -> int:
    try:
        config = load_config(path)
        if config.backend == "neuron":
            from trainer.neuron.layout import check_neuron_config  # stdlib only, like trainer.config

            check_neuron_config(config, world_size)
        elif world_size is not None:
            config.batch_layout(world_size)
    except ConfigError as e:
        for line in e.errors:
            print(line)
        return EXIT_DO_NOT_RETRY
    print("ok")
    return EXIT_OK


def _print(path: str) -> int:
    try:
        config = load_config(path)
    except ConfigError as e:
        for line in e.errors:
            print(line)
        return EXIT_DO_NOT_RETRY
    resolved = {"config": config_to_dict(config), "shape": asdict(config.shape),
                "parameters": config.shape.parameter_count(),
                "config_digest": config_digest(config)}
    print(json.dumps(resolved, indent=2))
    return EXIT_OK


def _train(path: str, resume: str) -> int:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"trainer[rank {rank}] %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(path)
        if config.backend == "neuron":
            from trainer.neuron.train import train_neuron  # the Neuron SDK is imported here

            train_neuron(config, resume=resume)
        else:
            from trainer.train import train  # torch is imported here, not before

            train(config, resume=resume)
    except DoNotRetry as e:
        print(f"trainer[rank {rank}]: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except BaseException as e:
        code = exit_code_for(e)
        if code != EXIT_OK:
            traceback.print_exc()
        return code
    return EXIT_OK


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown. By now the process group is destroyed,
    telemetry has said Exit, result.json and every checkpoint are written and renamed
    into place, and the logs are flushed below; what is left is torch's and its thread
    pools' finalization, which takes seconds here (2.3 s of a 4-rank tiny run on 2 cores)
    and can hang outright on a broken interconnect. A rank that is done should be seen
    done: the supervisor ends the attempt, or judges the fault, as soon as it is gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
