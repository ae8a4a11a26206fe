"""Export a trained EAGLE-3 draft for SGLang and for vLLM (speculators format), and load it back.

SGLang format (`LlamaForCausalLMEagle3`, docs/DESIGN.md §7): config.json with `eagle_config`
and model.safetensors with the names in export_checks.sglang_weight_table; aux layer ids
in the "output of layer i" convention. The target's embedding is not stored.

speculators format (vllm-project/speculators `Eagle3SpeculatorConfig`, read by vLLM's
`SpeculatorsConfig` + `update_eagle3`): config.json with `speculators_model_type: eagle3`,
`architectures: ["Eagle3Speculator"]`, the decoder layer's Llama config under
`transformer_layer_config`, and `speculators_config` {algorithm "eagle3", one greedy
proposal method with `speculative_tokens`, default_proposal_method "greedy", verifier
{name_or_path, architectures}}; name_or_path is the target's model folder as an absolute
path (or its hub id as given), because speculators and vLLM open it from whatever directory
they run in (verifier_reference). Weight names map from SGLang's as:

    midlayer.<rest>  -> layers.0.<rest>     (e.g. midlayer.self_attn.q_proj.weight)
    fc.weight, norm.weight, lm_head.weight, d2t, t2d -> unchanged

No embed_tokens.weight: vLLM shares the verifier's embedding when the draft has none.
Two values differ from the SGLang export on purpose:
- `eagle_aux_hidden_state_layer_ids` is written in vLLM's convention, where id k captures
  the residual stream entering layer k, i.e. the output of layer k-1: SGLang ids + 1
  ([1, 29, 57] -> [2, 30, 58]); vLLM's own default (2, L//2, L-3) is the same rule.
- `norm_before_residual: false` is written explicitly: vLLM's update_eagle3 defaults it to
  true, while this draft (like SGLang's) keeps the residual before hidden_norm.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tasks.draft.architecture import DraftConfig
from tasks.draft.export_checks import (
    FLOAT_DTYPES,
    SGLANG_ARCHITECTURE,
    ExportError,
    as_sglang_reads,
    check_sglang_export,
    dtype_name,
    from_speculators,
    speculators_config,
    to_speculators_weights,
)
from tasks.draft.model import Eagle3Draft
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import TRAIN_BEST, TRAIN_FINAL, TRAIN_FINAL_SPECULATORS

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


# DraftConfig fields that config.json carries under the same name.
_SAME_NAME = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
    "initializer_range", "vocab_size", "draft_vocab_size", "target_hidden_size",
)


def sglang_config(cfg: DraftConfig, dtype: str, extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [SGLANG_ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        **{key: getattr(cfg, key) for key in _SAME_NAME},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        # Not read by SGLang; lets load_exported rebuild the exact DraftConfig.
        "eaglescale": {
            "target_num_layers": cfg.target_num_layers,
            "target_model_type": cfg.target_model_type,
            "aux_layer_convention": "output_of_layer",
        },
    }
    for key, value in (extra_config or {}).items():
        if key in config and config[key] != value:
            raise ExportError(f"extra_config may not override {key!r} ({config[key]!r} -> {value!r})")
        config[key] = value
    return config


def draft_config_from_sglang(config: dict[str, Any]) -> DraftConfig:
    ours = config.get("eaglescale") or {}
    aux = list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    defaults = {"hidden_act": "silu", "initializer_range": 0.02, "rope_scaling": None}
    return DraftConfig(
        **{key: config.get(key, defaults.get(key)) for key in _SAME_NAME},
        aux_layer_ids=aux,
        # A foreign checkpoint does not record the target's depth; the L - 4 rule of the
        # last aux layer is the best estimate.
        target_num_layers=int(ours.get("target_num_layers") or aux[-1] + 4),
        target_model_type=str(ours.get("target_model_type") or "llama"),
        tie_word_embeddings=False,
    )


def exportable_weights(model: Eagle3Draft, dtype: str | None) -> tuple[dict[str, torch.Tensor], str]:
    """The draft's exportable tensors on CPU, floats cast to `dtype` (default: as trained)."""
    state = model.exportable_state_dict()
    floats = [t.dtype for t in state.values() if t.is_floating_point()]
    name = dtype or dtype_name(floats[0] if floats else torch.float32)
    target = FLOAT_DTYPES.get(name)
    if target is None:
        raise ExportError(f"unsupported export dtype {name!r}; use float32, bfloat16 or float16")
    out = {}
    for key, tensor in state.items():
        tensor = tensor.detach().to("cpu")
        out[key] = (tensor.to(target) if tensor.is_floating_point() else tensor).contiguous()
    return out, name


def expected_aux_layers(
    cfg: DraftConfig, expected: Sequence[int] | None, run: RunFolder | None
) -> tuple[list[int] | None, str]:
    """The aux layer ids the export must carry, and where that expectation comes from."""
    if run is None:
        return (list(expected) if expected is not None else None), "expected"
    from tasks.draft.data import training_data_metadata

    try:
        meta = training_data_metadata(run)
    except FileNotFoundError as err:
        raise ExportError(f"cannot check aux layer ids against the extraction: {err}") from err
    where = (f"the online training data of {run.url}" if meta.get("hidden_states") == "online"
             else f"the extraction in {run.url}/extract")  # fmt: skip
    if meta["hidden_size"] != cfg.target_hidden_size:
        raise ExportError(
            f"draft target_hidden_size {cfg.target_hidden_size} differs from the hidden_size "
            f"{meta['hidden_size']} of {where}"
        )
    ids = list(meta["aux_layer_ids"])
    if expected is not None and list(expected) != ids:
        raise ExportError(f"expected aux layer ids {list(expected)} differ from the {ids} of {where}")
    return ids, where


def sglang_files(
    model: Eagle3Draft,
    extra_config: dict[str, Any] | None = None,
    expected_aux_layer_ids: Sequence[int] | None = None,
    run: RunFolder | None = None,
    dtype: str | None = None,
) -> dict[str, bytes]:
    """config.json and model.safetensors bytes, checked; nothing is written."""
    weights, name = exportable_weights(model, dtype)
    config = sglang_config(model.config, name, extra_config)
    expected, source = expected_aux_layers(model.config, expected_aux_layer_ids, run)
    check_sglang_export(weights, config, expected, source, where="SGLang export")
    return {WEIGHTS: st_save(weights, metadata={"format": "pt"}), CONFIG: _json(config)}


def _is_converted_target(verifier: str) -> bool:
    """A package, multi-part or GGUF target: what transformers opens is its converted HF folder."""
    from tasks.target.multipart import is_multipart_path
    from tasks.target.packages import is_package_path

    return is_package_path(verifier) or is_multipart_path(verifier) or verifier.endswith(".gguf")


def verifier_reference(verifier: str) -> str:
    """What config.json records as the verifier: a name or path that resolves from anywhere.

    speculators (and vLLM) open `verifier.name_or_path` with transformers from whatever
    directory they run in, so a local folder is recorded as its absolute path; a package or GGUF
    target (`package://...`, `*.gguf`) as the absolute path of its converted HF folder, which is
    what transformers can open (a `multipart://` one likewise); a hub id (`org/name`, or a bare name) and a URL are recorded as
    given. A path that does not exist is refused rather than recorded.
    """
    if _is_converted_target(verifier):
        from tasks.target.model_dir import resolve_model_dir

        return str(resolve_model_dir(verifier).resolve())
    if not verifier or "://" in verifier:
        return verifier
    path = Path(verifier).expanduser()
    if path.exists():
        return str(path.resolve())
    if path.is_absolute() or verifier.startswith((".", "~")) or verifier.count("/") > 1:
        raise ExportError(
            f"verifier {verifier!r} is a path, but {path.absolute()} does not exist (pass the "
            "target's model folder or its hub id)"
        )
    return verifier


def verifier_architectures_of(verifier: str) -> list[str]:
    """The verifier's architectures when it is a local model folder (hub ids are not fetched)."""
    if _is_converted_target(verifier):
        verifier = verifier_reference(verifier)
    config = Path(verifier).expanduser() / CONFIG
    if "://" not in verifier and config.is_file():
        return list(json.loads(config.read_text()).get("architectures") or [])
    return []


def speculators_files(
    model: Eagle3Draft,
    verifier_name: str,
    verifier_architectures: Sequence[str] | None = None,
    speculative_tokens: int = 3,
    expected_aux_layer_ids: Sequence[int] | None = None,
    run: RunFolder | None = None,
    dtype: str | None = None,
) -> dict[str, bytes]:
    """config.json and model.safetensors bytes, checked; nothing is written. The verifier is
    recorded as verifier_reference() says; its architectures default to its own config's."""
    weights, name = exportable_weights(model, dtype)
    sg_config = sglang_config(model.config, name)
    expected, source = expected_aux_layers(model.config, expected_aux_layer_ids, run)
    check_sglang_export(weights, sg_config, expected, source, where="speculators export")
    verifier = verifier_reference(verifier_name)
    if verifier_architectures is None:
        verifier_architectures = verifier_architectures_of(verifier)
    config = speculators_config(sg_config, verifier, verifier_architectures, speculative_tokens)
    # Re-derive and re-check from what will be written, so the mapping itself is tested.
    back_config, back_weights = from_speculators(config, to_speculators_weights(weights))
    check_sglang_export(back_weights, back_config, expected, source, where="speculators export")
    data = st_save(to_speculators_weights(weights), metadata={"format": "pt"})
    return {WEIGHTS: data, CONFIG: _json(config)}


def export_sglang(
    model: Eagle3Draft,
    out_dir: str | Path,
    extra_config: dict[str, Any] | None = None,
    *,
    expected_aux_layer_ids: Sequence[int] | None = None,
    run: RunFolder | None = None,
    dtype: str | None = None,
) -> Path:
    """Write the SGLang-loadable draft to a local folder, atomically; return the folder."""
    files = sglang_files(model, extra_config, expected_aux_layer_ids, run, dtype)
    return write_local_atomic(Path(out_dir), files)


def export_speculators(
    model: Eagle3Draft,
    out_dir: str | Path,
    verifier_name: str,
    *,
    verifier_architectures: Sequence[str] | None = None,
    speculative_tokens: int = 3,
    expected_aux_layer_ids: Sequence[int] | None = None,
    run: RunFolder | None = None,
    dtype: str | None = None,
) -> Path:
    """Write the vLLM speculators-format draft to a local folder, atomically."""
    files = speculators_files(
        model, verifier_name, verifier_architectures, speculative_tokens,
        expected_aux_layer_ids, run, dtype,
    )
    return write_local_atomic(Path(out_dir), files)


def export_to_run(
    model: Eagle3Draft,
    run: RunFolder,
    rel: str = TRAIN_FINAL,
    extra_config: dict[str, Any] | None = None,
    dtype: str | None = None,
) -> str:
    """SGLang export into the run folder (any fsspec store), aux ids checked against extraction.

    An old config.json goes first and the new one is written last, each object atomically,
    so a reader that finds config.json finds the weights that belong to it.
    """
    files = sglang_files(model, extra_config, None, run, dtype)
    run.remove(f"{rel}/{CONFIG}")
    run.write_bytes_atomic(f"{rel}/{WEIGHTS}", files[WEIGHTS])
    run.write_bytes_atomic(f"{rel}/{CONFIG}", files[CONFIG])
    return f"{run.url}/{rel}"


def export_run_draft(run: RunFolder, target_model_path: str) -> dict[str, Any]:
    """The train stage's exports of its best checkpoint: train/final (SGLang) and
    train/final-speculators (vLLM), on any store. Exports never hold the embedding (the server
    shares the target's), so none is loaded."""
    import tempfile

    from tasks.draft import checkpoint as ckpt

    best = run.read_json(TRAIN_BEST)
    if best is None:
        raise ExportError(f"{run.url}/{TRAIN_BEST} is missing: training produced no evaluated checkpoint")
    model = ckpt.load_run_checkpoint_model(run, best["checkpoint"])
    final = export_to_run(model, run, TRAIN_FINAL)
    # The speculators writer targets a local folder: write there, then copy into the run
    # folder, config.json last so a reader never finds it without its weights.
    with tempfile.TemporaryDirectory() as tmp:
        local = export_speculators(model, Path(tmp) / "speculators", target_model_path)
        names = sorted(p.name for p in Path(local).iterdir())
        for name in sorted(names, key=lambda n: n == CONFIG):
            run.write_bytes_atomic(f"{TRAIN_FINAL_SPECULATORS}/{name}", (Path(local) / name).read_bytes())
    return {"best": best, "final": final, "speculators": f"{run.url}/{TRAIN_FINAL_SPECULATORS}"}


def write_local_atomic(out_dir: Path, files: dict[str, bytes]) -> Path:
    """Fill a temp folder next to `out_dir`, then rename it into place (replacing any old one)."""
    out_dir = out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".tmp-{secrets.token_hex(6)}-{out_dir.name}"
    tmp.mkdir()
    try:
        for name in sorted(files, key=lambda n: n == CONFIG):
            with open(tmp / name, "wb") as f:
                f.write(files[name])
                f.flush()
                os.fsync(f.fileno())
        old = None
        if out_dir.exists():
            old = out_dir.parent / f".old-{secrets.token_hex(6)}-{out_dir.name}"
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def read_exported(source: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
    """(SGLang-style config, SGLang-named weights, format) of an exported folder, checked."""
    text = str(source)
    run = RunFolder(text) if "://" in text else None
    where = text
    try:
        raw_config = run.read_bytes(CONFIG) if run else (Path(source) / CONFIG).read_bytes()
        raw_weights = run.read_bytes(WEIGHTS) if run else (Path(source) / WEIGHTS).read_bytes()
    except FileNotFoundError as err:
        raise ExportError(f"{where}: not an exported draft ({err})") from err
    config = json.loads(raw_config)
    weights = st_load(raw_weights)
    if "speculators_model_type" in config:
        config, weights = from_speculators(config, weights)
        fmt = "speculators"
    else:
        config, fmt = as_sglang_reads(config, weights), "sglang"
    check_sglang_export(weights, config, where=where)
    return config, weights, fmt


def load_exported(out_dir: str | Path, embed_weight: torch.Tensor | None = None) -> Eagle3Draft:
    """Load either export format back into an Eagle3Draft (checked first)."""
    config, weights, _ = read_exported(out_dir)
    model = Eagle3Draft(draft_config_from_sglang(config), embed_weight=embed_weight)
    model.load_exportable_state_dict(weights)
    return model


def _json(obj: Any) -> bytes:
    buf = io.StringIO()
    json.dump(obj, buf, indent=2, sort_keys=True)
    return (buf.getvalue() + "\n").encode()


def _parse_layer_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--expect-aux-layers wants comma-separated integers, got {text!r}") from err


def export_main(argv: list[str] | None = None) -> int:
    """eaglescale export CHECKPOINT OUT_DIR --format sglang|speculators [--verifier NAME]
    [--expect-aux-layers 1,29,57] [--run RUN_ROOT] [--dtype bfloat16]"""
    parser = argparse.ArgumentParser(prog="eaglescale export", description="Export a draft checkpoint.")
    parser.add_argument("checkpoint", help="a train/checkpoints/step-N folder (with meta.json)")
    parser.add_argument("out_dir", help="output folder (replaced atomically)")
    parser.add_argument("--format", choices=("sglang", "speculators"), default="sglang")
    parser.add_argument("--verifier", help="target model folder or hub id (speculators format); "
                        "a folder is recorded as its absolute path")
    parser.add_argument("--expect-aux-layers", type=_parse_layer_ids, metavar="1,29,57",
                        help="refuse unless the draft's aux layer ids (output-of-layer) are these")
    parser.add_argument("--run", help="run root whose extraction the aux layer ids must match")
    parser.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), help="weight dtype (default: as trained)")
    parser.add_argument("--speculative-tokens", type=int, default=3, help="speculators' greedy proposal length")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if args.format == "speculators" and not args.verifier:
        print("eaglescale export: --format speculators needs --verifier NAME", file=sys.stderr)
        return 2
    from tasks.draft.checkpoint import CheckpointError, is_complete, load_checkpoint_model

    if "://" not in args.checkpoint and not Path(args.checkpoint).is_dir():
        print(f"eaglescale export: {args.checkpoint} is not a checkpoint folder", file=sys.stderr)
        return 1
    if not is_complete(args.checkpoint):
        print(
            f"eaglescale export: {args.checkpoint} is incomplete (no meta.json; the save was "
            "interrupted): pick an earlier step-N", file=sys.stderr,
        )
        return 1
    run = RunFolder(args.run) if args.run else None
    try:
        model = load_checkpoint_model(args.checkpoint)
        if args.format == "sglang":
            out = export_sglang(model, args.out_dir, expected_aux_layer_ids=args.expect_aux_layers,
                                run=run, dtype=args.dtype)
        else:
            out = export_speculators(
                model, args.out_dir, args.verifier, speculative_tokens=args.speculative_tokens,
                expected_aux_layer_ids=args.expect_aux_layers, run=run, dtype=args.dtype,
            )
    except (ExportError, CheckpointError, ValueError, FileNotFoundError) as err:
        print(f"eaglescale export: {err}", file=sys.stderr)
        return 1
    print(f"exported {args.format} draft to {out}")
    return 0
