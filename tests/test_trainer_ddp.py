"""The multi-process path: torchrun, 2 processes, gloo on CPU, DDP over the real train stage."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.draft import checkpoint as ckpt
from tasks.draft.data import build_index, plan_epoch
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import TRAIN_RESULT
from tests.draft_support import extracted_run
from tests.run_support import child_env

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_torchrun_two_processes_gloo(tmp_path_factory: pytest.TempPathFactory,
                                     tiny_target_dir: Path, tmp_path: Path):
    cfg, params = extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path / "ddp",
                                max_steps=STEPS, eval_every=8, save_every=8, learning_rate=1e-2)
    env = child_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "tasks.train.main", "--params", str(params)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    for rank in (0, 1):
        assert f"train_main rank {rank}/2 done: steps {STEPS}," in output, output[-3000:]

    run = RunFolder(cfg.run_root)
    last = ckpt.checkpoint_key(STEPS)
    assert ckpt.is_complete(run.path(last))
    state = json.loads(run.read_bytes(f"{last}/trainer_state.json"))
    losses = [h["loss"] for h in state["history"]]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3
    assert state["steps_per_epoch"] == len(plan_epoch(build_index(run), "train", 0,
                                                     cfg.train.seed, cfg.train.batch_tokens)) // 2

    # Step 1 trained on the plan's batches 0 (rank 0) and 1 (rank 1), summed over ranks.
    plan = plan_epoch(build_index(run), "train", 0, cfg.train.seed, cfg.train.batch_tokens)
    assert state["history"][0]["batch_tokens"] == sum(r.length for r in plan[0] + plan[1])
    result = run.read_json(TRAIN_RESULT)
    assert result["steps"] == STEPS and result["last_checkpoint"] == last
    assert [e["step"] for e in result["evals"]] == [0, 8, 16]
