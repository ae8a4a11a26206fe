"""Training checkpoints: train/checkpoints/step-N/, valid only once meta.json exists.

    model.safetensors    the exportable state dict (fp32 master weights; no embedding)
    draft_config.json    DraftConfig.to_dict()
    optimizer.pt         optimizer + LR scheduler state
    rng.pt               torch (CPU and CUDA), python and numpy RNG states
    trainer_state.json   step, data-loader position, metric history, best
    meta.json            written LAST: step and the sha256 of every file above

Every file goes through RunFolder.write_bytes_atomic, so this works on any fsspec root;
a folder without meta.json (a crash mid-save) is removed when training starts.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
import time
from typing import Any

import fsspec
import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tasks.draft.architecture import DraftConfig
from tasks.draft.model import Eagle3Draft
from tasks.runfolder import RunFolder

CKPT_ROOT = "train/checkpoints"
FILES = ("model.safetensors", "draft_config.json", "optimizer.pt", "rng.pt", "trainer_state.json")
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, or a file does not match the sha256 its meta.json records."""


def checkpoint_key(step: int) -> str:
    return f"{CKPT_ROOT}/step-{step}"


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def rng_state() -> dict[str, Any]:
    state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": [state[0], state[1].tolist(), *state[2:]],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))


def save_checkpoint(
    run: RunFolder,
    step: int,
    model: Eagle3Draft,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict[str, Any],
) -> str:
    """Write step-N (meta.json last) and return its run-relative key."""
    key = checkpoint_key(step)
    blobs = {
        "model.safetensors": st_save(model.exportable_state_dict(), metadata={"format": "pt"}),
        "draft_config.json": json.dumps(model.config.to_dict(), indent=2).encode(),
        "optimizer.pt": _torch_bytes(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
        ),
        "rng.pt": _torch_bytes(rng_state()),
        "trainer_state.json": json.dumps(trainer_state, indent=2, default=float).encode(),
    }
    for name, data in blobs.items():
        run.write_bytes_atomic(f"{key}/{name}", data)
    meta = {
        "step": step,
        "created_at": time.time(),
        "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in blobs.items()},
    }
    run.write_json_atomic(f"{key}/meta.json", meta)
    return key


def _steps(run: RunFolder) -> dict[int, bool]:
    """step -> complete, for every step-N folder."""
    out = {}
    for name in run.listdir(CKPT_ROOT):
        match = _STEP_DIR.match(name)
        if match:
            out[int(match.group(1))] = run.exists(f"{CKPT_ROOT}/{name}/meta.json")
    return out


def remove_incomplete(run: RunFolder) -> list[str]:
    removed = []
    for step, complete in _steps(run).items():
        if not complete:
            run.remove(checkpoint_key(step), recursive=True)
            removed.append(checkpoint_key(step))
    return removed


def complete_steps(run: RunFolder) -> list[int]:
    return sorted(step for step, complete in _steps(run).items() if complete)


def latest_checkpoint(run: RunFolder) -> str | None:
    steps = complete_steps(run)
    return checkpoint_key(steps[-1]) if steps else None


def prune_checkpoints(run: RunFolder, keep: int, protect: set[str]) -> list[str]:
    """Remove all but the newest `keep` complete checkpoints and those in `protect`."""
    steps = complete_steps(run)
    doomed = [checkpoint_key(s) for s in steps[: max(0, len(steps) - keep)]]
    doomed = [k for k in doomed if k not in protect]
    for key in doomed:
        run.remove(key, recursive=True)
    return doomed


class _Dir:
    """Verified reads from one checkpoint folder, by run key or by URL."""

    def __init__(self, url: str, fs: Any = None, root: str | None = None) -> None:
        self.url = url.rstrip("/")
        if fs is None:
            fs, root = fsspec.core.url_to_fs(self.url)
        self.fs, self.root = fs, str(root).rstrip("/")
        self.meta = self._meta()

    def _meta(self) -> dict[str, Any]:
        try:
            return json.loads(self.fs.cat_file(f"{self.root}/meta.json"))
        except FileNotFoundError:
            raise CheckpointError(f"{self.url}: no meta.json, not a complete checkpoint") from None

    def read(self, name: str) -> bytes:
        data = self.fs.cat_file(f"{self.root}/{name}")
        if hashlib.sha256(data).hexdigest() != self.meta["sha256"].get(name):
            raise CheckpointError(f"{self.url}/{name}: sha256 does not match meta.json")
        return data


def is_complete(ckpt_dir: str) -> bool:
    fs, root = fsspec.core.url_to_fs(str(ckpt_dir).rstrip("/"))
    return fs.exists(f"{root}/meta.json")


def load_checkpoint_model(ckpt_dir: str, embed_weight: torch.Tensor | None = None) -> Eagle3Draft:
    """The draft of a complete checkpoint (CPU, fp32); the embedding comes from the target."""
    return _load_model(_Dir(str(ckpt_dir)), embed_weight)


def load_run_checkpoint_model(
    run: RunFolder, key: str, embed_weight: torch.Tensor | None = None
) -> Eagle3Draft:
    """The same for a checkpoint named by its run key, through the run's filesystem (and its
    storage options: an s3 endpoint, say)."""
    return _load_model(_Dir(f"{run.url}/{key}", run.fs, run.path(key)), embed_weight)


def _load_model(folder: _Dir, embed_weight: torch.Tensor | None) -> Eagle3Draft:
    config = DraftConfig.from_dict(json.loads(folder.read("draft_config.json")))
    model = Eagle3Draft(config, embed_weight)
    model.load_exportable_state_dict(st_load(folder.read("model.safetensors")))
    return model


def load_training_state(
    run: RunFolder,
    key: str,
    model: Eagle3Draft,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG in place; return the trainer state."""
    folder = _Dir(f"{run.url}/{key}", run.fs, run.path(key))
    config = json.loads(folder.read("draft_config.json"))
    if config != model.config.to_dict():
        raise CheckpointError(f"{run.url}/{key}: draft config differs from this run's draft")
    model.load_exportable_state_dict(st_load(folder.read("model.safetensors")))
    device = next(model.parameters()).device
    opt = torch.load(io.BytesIO(folder.read("optimizer.pt")), map_location=device, weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    set_rng_state(torch.load(io.BytesIO(folder.read("rng.pt")), weights_only=True))
    return json.loads(folder.read("trainer_state.json"))


def read_trainer_state(run: RunFolder, key: str) -> dict[str, Any]:
    """The trainer state of a checkpoint alone (verified): what a resume checks first."""
    return json.loads(_Dir(f"{run.url}/{key}", run.fs, run.path(key)).read("trainer_state.json"))
