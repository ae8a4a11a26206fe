"""What a training checkpoint of the Qwen2.5-Coder-1.5B draft weighs when it travels from one H200
session to the next (issue 28), and how long each step of its way takes on this box:

    .venv/bin/python benchmarks/checkpoint_travel.py [--work DIR]

A real checkpoint of run 18's draft shape (QWEN_DRAFT) after one AdamW step, saved by the
trainer's save_checkpoint, packed as the node packs it, brought back as `node checkpoint K`
does, joined and checked, unpacked as `prepare --checkpoint-from` does and loaded as the resume
loads it, with the device calls each way. The weights are random: sizes and times do not depend
on them. Prints one JSON object (BENCHMARKS.md, P20).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from gpunode import node_env, payload, travel  # noqa: E402
from tasks.config.sections import TrainConfig  # noqa: E402
from tasks.draft.architecture import DraftConfig  # noqa: E402
from tasks.draft.checkpoint import load_training_state, save_checkpoint  # noqa: E402
from tasks.draft.model import Eagle3Draft  # noqa: E402
from tasks.draft.trainer import build_optimizer  # noqa: E402
from tasks.runfolder import RunFolder  # noqa: E402

# Run 18's draft of Qwen2.5-Coder-1.5B-Instruct (its exported config.json).
QWEN_DRAFT = DraftConfig(
    hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
    rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, max_position_embeddings=32768, vocab_size=151936,
    draft_vocab_size=32000, aux_layer_ids=[1, 13, 24], target_hidden_size=1536, target_num_layers=28,
    target_model_type="qwen2",
)  # fmt: skip
STEP, TOTAL_STEPS, STEPS_PER_EPOCH = 400, 612, 204  # where run 18's 3-epoch schedule would stand at step 400


def _draft() -> tuple[Eagle3Draft, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    draft = Eagle3Draft(QWEN_DRAFT, torch.zeros(QWEN_DRAFT.vocab_size, QWEN_DRAFT.hidden_size))
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(params, TrainConfig(), TOTAL_STEPS, torch.device("cpu"))
    return draft, optimizer, scheduler


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", help="a scratch folder (default: a temporary one, removed after)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="checkpoint-travel-"))
    figures: dict[str, object] = {}
    try:
        draft, optimizer, scheduler = _draft()
        params = [p for p in draft.parameters() if p.requires_grad]
        figures["trainable_parameters"] = sum(p.numel() for p in params)
        for p in params:  # one step: AdamW's two moments exist, as in any checkpoint after step 1
            p.grad = torch.randn_like(p) * 1e-3
        optimizer.step()
        scheduler.step()
        run = RunFolder(str(work / "node/run"))
        began = time.perf_counter()
        save_checkpoint(run, STEP, draft, optimizer, scheduler, {
            "step": STEP, "total_steps": TOTAL_STEPS, "steps_per_epoch": STEPS_PER_EPOCH, "history": [], "evals": [],
            "best": {"step": STEP, "sim_accept": 0.9, "sim_accept_len": 1.9}})  # fmt: skip
        figures["save_s"] = time.perf_counter() - began
        run.write_json_atomic("train/best.json", {"step": STEP, "checkpoint": f"train/checkpoints/step-{STEP}"})
        # The node's side: pack, then the calls that bring the parts back.
        node_env.NODE = work / "node"
        began = time.perf_counter()
        members = travel.checkpoint_members(work / "node/run")
        index = travel.pack_parts(members, {"checkpoint": f"train/checkpoints/step-{STEP}"}, name="checkpoint")
        figures["pack_s"] = time.perf_counter() - began
        figures["files"] = {p.name: p.stat().st_size for p in sorted((work / f"node/run/train/checkpoints/step-{STEP}").iterdir())}
        figures["bytes"], figures["parts"] = index["bytes"], len(index["parts"])
        calls = travel.calls_for(index["bytes"])
        figures["calls_back"], figures["calls_back_device_s"] = calls, calls * travel.SECONDS_PER_CALL
        began = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # each call's line: the figures are below
            for k in range(calls):
                os.environ["OUT"] = str(work / f"out-{k:02d}")
                travel.node_packed("checkpoint", k)
        figures["fetch_copy_s"] = time.perf_counter() - began
        # Here: join, check, unpack as prepare does, and the payload parts it adds forward.
        began = time.perf_counter()
        joined = work / "checkpoint.tar"
        with joined.open("wb") as f:
            for part in index["parts"]:
                f.write(next(work.glob(f"out-*/{part}")).read_bytes())
        assert node_env.sha256(joined) == index["sha256"], "the joined parts are not what the node packed"
        figures["join_and_check_s"] = time.perf_counter() - began
        began = time.perf_counter()
        travel.unpack_checkpoint(joined, work / "src")
        figures["unpack_s"] = time.perf_counter() - began
        figures["payload_parts_forward"] = -(-index["bytes"] // payload.part_bytes())
        # The next node's resume: weights, optimizer, schedule and RNG back, each file checked.
        draft2, optimizer2, scheduler2 = _draft()
        began = time.perf_counter()
        load_training_state(RunFolder(str(work / "src/run")), f"train/checkpoints/step-{STEP}", draft2, optimizer2, scheduler2)
        figures["load_s"] = time.perf_counter() - began
        same = all(torch.equal(a, b) for a, b in zip(draft.exportable_state_dict().values(),
                                                      draft2.exportable_state_dict().values(), strict=True))  # fmt: skip
        assert same, "the resumed weights differ from the saved ones"
        figures["resumed_weights_equal"] = same
        figures["box"] = f"{os.cpu_count()} CPUs"
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(figures, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
