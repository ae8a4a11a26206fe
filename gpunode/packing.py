"""What a session packs to travel to the next (travel.pack_parts: parts of what one call brings
back): the run's trained draft in bf16 (`node drafts K`), a stopped draft's newest checkpoint
whole (`node checkpoint K`) and the data-scaling drafts in bf16 (`node scaling-drafts K`)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpunode import node_env
from gpunode.node_env import read_json
from gpunode.travel import (
    SCALING_INDEX,
    SCALING_ROOT,
    checkpoint_members,
    exported_samples,
    newest_checkpoint,
    pack_parts,
    scaling_checkpoint,
)


def _export_bf16(py: Callable[..., Any], checkpoint: str, out: str, log: str) -> None:
    """`eaglescale export` of `checkpoint` in bf16 (SGLang's EAGLE3 format), through the pipeline's `py`."""
    py(["-m", "flows.cli", "export", checkpoint, out, "--format", "sglang", "--dtype", "bfloat16"], log)


class Packing:
    def pack_run_draft(self) -> None:
        """The run's draft for a later session's payload (`prepare --draft-from`, its parts
        brought back by `node drafts K`): the best checkpoint exported in bf16, the dtype SGLang
        serves it in (half the fp32 export's bytes: 212 MB for the Qwen draft), as
        run/train/final, beside what the gate and the scaling drafts read (data.json, the
        vocabulary map) and the training's record (result, best, its plot, the forecast it was
        set beside under train.forecast_full_draft). Not its checkpoints
        (1.27 GB each with the optimizer's state: a draft that did not finish travels so
        instead, pack_run_checkpoint), nor the vLLM export: a later session gates this draft."""
        best = read_json(self.run_root / "train/best.json")
        if not best:
            raise RuntimeError(f"{self.run_root}/train/best.json is missing: no trained draft to pack")
        out = node_env.NODE / "draft-bf16"
        shutil.rmtree(out, ignore_errors=True)
        _export_bf16(self.py, str(self.run_root / best["checkpoint"]), str(out), "draft-export")
        train = self.run_root / "train"
        members = {"run/train/final": out}
        for rel in ("data.json", "vocab_map.safetensors", "result.json", "best.json", "plots/accuracy.png",
                    "forecast.json", "forecast-check.json"):  # the pre-registered forecast, for the gate's report
            if (train / rel).is_file():
                members[f"run/train/{rel}"] = train / rel
        index = pack_parts(members, {"drafts": {"run": str(train / "final")}, "dtype": "bfloat16",
                                     "checkpoint": best["checkpoint"]})  # fmt: skip
        self.save_measure("drafts", index)

    def pack_run_checkpoint(self) -> None:
        """The draft's newest checkpoint, stopped before the end of its schedule, for the next
        session's fresh node (`prepare --checkpoint-from`, its parts brought back by `node
        checkpoint K`): whole, optimizer and RNG state with it, so that the resume there is the
        resume here (checkpoint_members). 1.27 GB for the Qwen draft: 22 calls back, 33 payload
        parts forward (BENCHMARKS P20). Under train.forecast_full_draft the scaling drafts train
        first: those finished on this node travel with it, exported, and those carried in only
        by their records (scaling_members), so that the next node trains none of them again."""
        newest = newest_checkpoint(self.run_root)
        if newest is None:
            raise RuntimeError(f"{self.run_root}: no complete checkpoint of the stopped draft: nothing to pack")
        members = checkpoint_members(self.run_root)
        if (self.run_root / SCALING_INDEX).is_file():
            members.update(self.scaling_members())
        state = read_json(newest / "trainer_state.json") or {}
        index = pack_parts(members, {"checkpoint": str(newest.relative_to(self.run_root)), "step": state.get("step"),
                                     "total_steps": state.get("total_steps"), "exports": exported_samples(members)},
                           name="checkpoint")  # fmt: skip
        self.save_measure("checkpoint", index)

    def pack_scaling_drafts(self) -> None:
        """The data-scaling drafts for a later session's payload (`prepare --scaling-from`, their
        parts brought back by `node scaling-drafts K`): the index the gate reads, each finished
        draft's record (result.json, best.json) and the export of each one finished on this node
        (scaling_members). Not their checkpoints: the next session gates them and trains none."""
        index = read_json(self.run_root / SCALING_INDEX)
        if not index or not index.get("drafts"):
            raise RuntimeError(f"{self.run_root / SCALING_INDEX} lists no finished scaling drafts to pack")
        members = self.scaling_members()
        packed = pack_parts(members, {"scaling-drafts": [d["samples"] for d in index["drafts"]],
                                      "exports": exported_samples(members), "dtype": "bfloat16"},
                            name="scaling-drafts")  # fmt: skip
        self.save_measure("scaling-drafts", packed)

    def scaling_members(self) -> dict[str, Path]:
        """The scaling index and, per finished draft it lists, its record (result.json,
        best.json), by name in the tar; with the export of each draft finished on this node (its
        best checkpoint in bf16, as its final). A draft carried in (an export and record with no
        checkpoint: an earlier session trained it) travels by its record only: the session that
        trained it brought its export back, and the next prepare takes it from that session's
        tar (travel.unpack_oldest_first), so ~210 MB a draft does not go back and forth
        every session."""
        scaling = self.run_root / SCALING_ROOT
        index = read_json(scaling / "index.json") or {}
        members = {f"run/{SCALING_INDEX}": scaling / "index.json"}
        for entry in index.get("drafts", []):
            final = self.run_root / entry["final"]
            folder = final.parent  # train/scaling/frac-N
            checkpoint = scaling_checkpoint(folder)
            if checkpoint is not None:
                out = node_env.NODE / "scaling-bf16" / folder.name
                shutil.rmtree(out, ignore_errors=True)
                _export_bf16(self.py, str(checkpoint), str(out), f"scaling-export-{folder.name}")
                members[f"run/{entry['final']}"] = out
            elif not (final / "config.json").is_file():
                raise RuntimeError(f"{folder}: neither a complete checkpoint nor an export of the scaling draft")
            for rel in ("result.json", "best.json"):
                if (folder / rel).is_file():
                    members[f"run/{SCALING_ROOT}/{folder.name}/{rel}"] = folder / rel
        return members
