"""Draft-training tests' data: a run on the tiny target with discover, generate (greedy, the
local engine) and extract committed by the real stages, built once per session and copied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.config import EagleScaleConfig, load_config
from tasks.extract.stage import ExtractStage
from tasks.runfolder import RunFolder
from tasks.target.tokenizer import load_tokenizer
from tests.run_support import copy_template_run, generate_all, write_params

TOTAL_PROMPTS = 240
SHARD_SIZE = 40
MAX_NEW_TOKENS = 48
# Small and fast on 2 cores, still enough to learn the tiny target's greedy continuations.
TRAIN = {
    "draft_vocab_size": 1024,
    "ttt_steps": 3,
    "learning_rate": 3e-3,
    "warmup_steps": 5,
    "batch_tokens": 1024,
    "max_grad_norm": 1.0,
    "eval_every": 40,
    "save_every": 40,
    "logits_chunk": 512,
    "intermediate_size": 128,
}


def _build(cfg: EagleScaleConfig) -> None:
    generate_all(cfg, batch_size=32)
    run = RunFolder(cfg.run_root)
    extract = ExtractStage(cfg, run, load_tokenizer(cfg.target.model_path))
    for shard_id in extract.prepare():
        extract.run_shard(shard_id)
    extract.finish()
    extract.close()


def params_for(dest: Path, model_dir: Path, **train: Any) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    return write_params(
        dest,
        model_dir,
        str(dest / "run"),
        sampling={"max_new_tokens": MAX_NEW_TOKENS},
        engine={"kind": "local", "batch_size": 32},
        generate={"shard_size": SHARD_SIZE},
        discover={"total_prompts": TOTAL_PROMPTS, "holdout_per_domain": 4},
        extract={"batch_size": 16, "max_length": 512, "eval_fraction": 0.2},
        train={**TRAIN, **train},
    )


def extracted_run(base: Path, model_dir: Path, dest: Path, **train: Any) -> tuple[EagleScaleConfig, Path]:
    """A run under `dest` with discover, generate and extract committed (copied from one
    built once per session under `base`), and its params file with `train` overrides."""

    def build(template: Path) -> Path:
        _build(load_config(params_for(template, model_dir)))
        return template / "run"

    copy_template_run("draft-template", base, model_dir, dest, build)
    params = params_for(dest, model_dir, **train)
    return load_config(params), params
