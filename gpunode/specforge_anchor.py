"""The anchor: SpecForge 0.2.0 trains an EAGLE-3 draft on the run's own regenerated sequences.

SpecForge's own training entry point (`specforge` CLI: its runtime, data plane and trackers)
needs wandb, yunchang and an SGLang-served target, which the H200 node does not have; so this
drives SpecForge's own draft model (`LlamaForCausalLMEagle3`), its training-time-test objective
(`OnlineEagle3Model`, compact teacher from the target's last hidden state and lm_head, loss
weight 0.8^k), its optimizer (`BF16Optimizer`: fp32 masters, grad clip, warm-up + cosine) and
its SGLang exporter (`export_to_sglang`) over exactly the batches eaglescale's trainer sees:
the same extracted hidden states, epoch plans, batch sizes, vocabulary map (d2t/t2d),
learning rate, schedule, clip and number of steps. SpecForge's offline conventions are kept:
input ids and the teacher's hidden state shifted left by one (its TargetHead.preprocess), the
last token of each sequence out of the loss (its normalize_offline_sample).

    PYTHONPATH=SPECFORGE_SITE python3 -m gpunode.specforge_anchor --params P.yaml --out DIR
    python3 -m gpunode.specforge_anchor --params P.yaml --out DIR --max-steps 3  # smoke

Writes DIR/draft (SGLang EAGLE3 folder, from SpecForge's exporter) and DIR/specforge_train.json
(steps, tokens, seconds, tok/s, losses, per-position accuracy of the last step).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _specforge() -> dict[str, Any]:
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.export.to_sglang import export_to_sglang
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    from specforge.utils import padding

    return {"model": OnlineEagle3Model, "export": export_to_sglang, "draft": LlamaForCausalLMEagle3,
            "optimizer": BF16Optimizer, "padding": padding}  # fmt: skip


def draft_config_dict(target: dict[str, Any], train: Any, aux_ids: list[int], draft_vocab: int) -> dict[str, Any]:
    """SpecForge's draft config for this target (its LlamaConfig fields), the shape eaglescale's
    own draft has: one layer of the target's width, the target's intermediate size by default."""
    from tasks.draft.architecture import rope_of

    theta, scaling = rope_of(target)
    heads = int(target["num_attention_heads"])
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": int(target["hidden_size"]),
        "intermediate_size": int(train.intermediate_size or target["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(target.get("num_key_value_heads", heads)),
        "head_dim": int(target.get("head_dim") or target["hidden_size"] // heads),
        "hidden_act": "silu",
        "rms_norm_eps": float(target["rms_norm_eps"]),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": int(target["max_position_embeddings"]),
        "vocab_size": int(target["vocab_size"]),
        "draft_vocab_size": draft_vocab,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "pretraining_tp": 1,
        "pad_token_id": None,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids), "use_aux_hidden_state": True},
    }


def specforge_inputs(batch: Any, padding: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """One eaglescale batch in SpecForge's offline training layout."""
    lengths = batch.lengths.to(device)
    positions = torch.arange(batch.input_ids.shape[1], device=device)
    attention_mask = (positions[None, :] < lengths[:, None]).long()
    loss_mask = batch.loss_mask.to(device).long()
    loss_mask[torch.arange(len(lengths), device=device), lengths - 1] = 0  # normalize_offline_sample
    return {
        "input_ids": padding(batch.input_ids.to(device), left=False),
        "attention_mask": attention_mask,
        "loss_mask": loss_mask[..., None],
        "hidden_states": batch.aux_hidden.to(device, torch.bfloat16),
        "target_hidden_for_compact": padding(batch.last_hidden.to(device, torch.bfloat16), left=False),
    }


def _build(cfg: Any, sf: dict[str, Any], vocab: Any, draft_cfg: dict[str, Any], backend: str, total: int,
           device: torch.device) -> tuple[Any, Any, Any, torch.Tensor]:  # fmt: skip
    """SpecForge's draft (the target's embedding, eaglescale's vocabulary map), its TTT model and
    optimizer, and the target's lm_head on the device."""
    from transformers import LlamaConfig

    from tasks.draft.target_heads import load_target_heads

    train = cfg.train
    torch.manual_seed(train.seed)
    config = LlamaConfig(**{k: v for k, v in draft_cfg.items() if k not in ("architectures", "eagle_config")})
    config.draft_vocab_size = vocab.draft_vocab_size
    draft = sf["draft"](config, attention_backend=backend).to(device, torch.bfloat16)
    embed, lm_head = load_target_heads(cfg.target.model_path)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed.to(device, torch.bfloat16))
        draft.t2d.copy_(vocab.t2d.to(device))
        draft.d2t.copy_(vocab.d2t.to(device))
    draft.embed_tokens.weight.requires_grad_(False)
    model = sf["model"](draft, length=train.ttt_steps, attention_backend=backend)
    optimizer = sf["optimizer"](draft, lr=train.learning_rate, weight_decay=train.weight_decay,
                                max_grad_norm=train.max_grad_norm, total_steps=total,
                                warmup_ratio=train.warmup_steps / total)  # fmt: skip
    return draft, model, optimizer, lm_head.to(device, torch.bfloat16)


def _loop(train: Any, run: Any, index: Any, sf: dict[str, Any], parts: tuple[Any, Any, torch.Tensor], total: int,
          device: torch.device, stop_file: Path | None) -> dict[str, Any]:  # fmt: skip
    """The steps over eaglescale's epoch plans, to `total` or until `stop_file` exists."""
    from tasks.draft.data import ShardReader, iter_batches, plan_epoch

    model, optimizer, head = parts
    reader = ShardReader(run, index)
    step, tokens, losses, last_acc = 0, 0, [], []
    epoch, stopped = 0, False
    while step < total and not stopped:
        batches = plan_epoch(index, "train", epoch, train.seed, train.batch_tokens)
        for batch in iter_batches(reader, batches, pin=device.type == "cuda"):
            inputs = specforge_inputs(batch, sf["padding"], device)
            plosses, _, acces, *_ = model(target=None, target_head_weight=head, **inputs)
            loss = sum(train.ttt_decay**i * p for i, p in enumerate(plosses))
            loss.backward()
            optimizer.step()
            step += 1
            tokens += batch.tokens
            stopped = step < total and stop_file is not None and stop_file.exists()
            if step % 50 == 0 or step == total or stopped:
                losses.append({"step": step, "loss": loss.item()})
                last_acc = [float(a) for a in acces]
            if step >= total or stopped:
                break
        epoch += 1
    return {"steps": step, "stopped_early": stopped, "train_tokens": tokens, "losses": losses, "last_step_acc": last_acc}


def train_specforge(
    params: str, out: Path, backend: str, max_steps: int | None, device_name: str, stop_file: Path | None = None
) -> dict[str, Any]:
    """Train for the train config's steps (or `max_steps`); once `stop_file` exists, stop at the
    step reached and export that (the result says so: `stopped_early`)."""
    from tasks.config import load_config
    from tasks.draft.data import build_index, plan_epoch
    from tasks.draft.vocab import VocabMap
    from tasks.extract.storage import extract_metadata
    from tasks.runfolder import RunFolder
    from tasks.target.model_dir import read_model_config, resolve_model_dir, text_config

    sf = _specforge()
    cfg = load_config(params)
    train = cfg.train
    run = RunFolder(cfg.run_root, cfg.storage_options)
    device = torch.device(device_name)
    vocab = VocabMap.load(run)  # the map eaglescale's trainer built: the same draft vocabulary
    index = build_index(run)
    steps_per_epoch = len(plan_epoch(index, "train", 0, train.seed, train.batch_tokens))
    total = max_steps or train.max_steps or train.epochs * steps_per_epoch
    target = text_config(read_model_config(resolve_model_dir(cfg.target.model_path)))
    draft_cfg = draft_config_dict(target, train, extract_metadata(run)["aux_layer_ids"], vocab.draft_vocab_size)
    draft, model, optimizer, head = _build(cfg, sf, vocab, draft_cfg, backend, total, device)
    began = time.perf_counter()
    trained = _loop(train, run, index, sf, (model, optimizer, head), total, device, stop_file)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:  # SpecForge's own exporter, from its state file
        state = Path(tmp) / "training_state.pt"
        torch.save({"strategy": "eagle3", "draft_state_dict": {k: v.cpu() for k, v in draft.state_dict().items()}}, state)
        config_path = Path(tmp) / "draft_config.json"
        config_path.write_text(json.dumps(draft_cfg))
        sf["export"](str(state), str(config_path), str(out / "draft"))
    result = {"trainer": "specforge 0.2.0 (draft model, TTT objective, optimizer, exporter)", "backend": backend,
              "steps": trained["steps"], "planned_steps": total, "stopped_early": trained["stopped_early"],
              "train_tokens": trained["train_tokens"], "seconds": seconds, "tok_per_s": trained["train_tokens"] / seconds,
              "learning_rate": train.learning_rate, "batch_tokens": train.batch_tokens,
              "ttt_steps": train.ttt_steps, "losses": trained["losses"], "last_step_acc": trained["last_step_acc"],
              # beside eaglescale's trainers on one GPU, what it needs of it
              "cuda_peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
              "draft": str(out / "draft")}  # fmt: skip
    (out / "specforge_train.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", required=True, help="the run's params YAML (its run_root is read)")
    parser.add_argument("--out", required=True, help="output folder: draft/ and specforge_train.json")
    parser.add_argument("--backend", default="sdpa", choices=["sdpa", "flex_attention"],
                        help="SpecForge attention backend (sdpa takes the padding mask of mixed-length batches)")
    parser.add_argument("--max-steps", type=int, help="stop after N steps (default: the train config's)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--stop-file", type=Path, help="stop training once this file exists, and export")
    args = parser.parse_args()
    result = train_specforge(args.params, Path(args.out), args.backend, args.max_steps, args.device, args.stop_file)
    print(json.dumps({k: v for k, v in result.items() if k not in ("losses",)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
