"""The train stage's training as its own process, for torchrun (one process per GPU, or gloo
on CPU):

    python -m torch.distributed.run --nproc_per_node 2 -m tasks.train.main --params FILE

FILE is the run's params YAML (the EagleScaleConfig); `--set train.max_steps=100` overrides.
Every rank runs tasks/train/stage.py's train_drafts (the draft, then the data-scaling drafts
when configured) and trains its share of each step (DDP); rank 0 writes checkpoints,
train/best.json and train/result.json. The export is not done here: the stage exports once
torchrun has returned (run_train_stage). Each rank prints one line when it finishes:
`train_main rank R/W done: steps S, last loss L`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist

from tasks.config import ConfigError, load_config
from tasks.draft.trainer import TrainError
from tasks.train.stage import train_drafts


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.train.main", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", required=True, help="params YAML of the run")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a params key (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.params, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        if cfg.train.device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(_backend(cfg.train.device))
    try:
        result = train_drafts(cfg)
    except (TrainError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if distributed:
            dist.destroy_process_group()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if result is None:  # train.forecast_full_draft: a scaling draft stopped for the time budget first
        print(f"train_main rank {rank}/{world}: stopped for the time budget before the full draft", flush=True)
        return 0
    last = result.history[-1]["loss"] if result.history else float("nan")
    print(f"train_main rank {rank}/{world} done: steps {result.steps}, last loss {last:.6f}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
