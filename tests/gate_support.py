"""Helpers for the gate tests: a crafted SGLang draft folder, a tiny target config, and a run
folder with a committed held-out prompt set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from safetensors.numpy import save_file

from tasks.discover.commit import commit_discovery
from tasks.discover.result import FILTERED_SCHEMA, MANIFEST_SCHEMA, QUARANTINE_SCHEMA
from tasks.runfolder import RunFolder

# The tiny target's shape (tests/conftest.py): 8 layers -> EAGLE-3 aux ids [1, 3, 4].
TARGET_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
}
AUX_IDS = [1, 3, 4]


def draft_config(**overrides: Any) -> dict[str, Any]:
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": 2048,
        "draft_vocab_size": 256,
        "tie_word_embeddings": False,
        "target_hidden_size": 64,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_IDS), "use_aux_hidden_state": True},
    }
    config.update(overrides)
    return config


def draft_tensors(config: dict[str, Any], fc_in: int | None = None, lm_rows: int | None = None,
                  d2t_len: int | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    h, inter = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    dv, v = config["draft_vocab_size"], config["vocab_size"]
    f = np.float32
    return {
        "fc.weight": np.zeros((h, fc_in if fc_in is not None else 3 * config["target_hidden_size"]), f),
        "midlayer.self_attn.q_proj.weight": np.zeros((q, 2 * h), f),
        "midlayer.self_attn.k_proj.weight": np.zeros((kv, 2 * h), f),
        "midlayer.self_attn.v_proj.weight": np.zeros((kv, 2 * h), f),
        "midlayer.self_attn.o_proj.weight": np.zeros((h, q), f),
        "midlayer.mlp.gate_proj.weight": np.zeros((inter, h), f),
        "midlayer.mlp.up_proj.weight": np.zeros((inter, h), f),
        "midlayer.mlp.down_proj.weight": np.zeros((h, inter), f),
        "midlayer.hidden_norm.weight": np.ones(h, f),
        "midlayer.input_layernorm.weight": np.ones(h, f),
        "midlayer.post_attention_layernorm.weight": np.ones(h, f),
        "norm.weight": np.ones(h, f),
        "lm_head.weight": np.zeros((lm_rows if lm_rows is not None else dv, h), f),
        "d2t": np.zeros(d2t_len if d2t_len is not None else dv, np.int64),
        "t2d": np.zeros(v, np.bool_),
    }


def write_draft(path: Path, config: dict[str, Any] | None = None, **tensor_overrides: Any) -> Path:
    """An SGLang draft folder: config.json + model.safetensors with the right tiny shapes."""
    config = config or draft_config()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(draft_tensors(config, **tensor_overrides), str(path / "model.safetensors"))
    return path


def commit_holdout(run: RunFolder, per_domain: int = 3, domains: tuple[str, ...] = ("chat", "code")) -> pa.Table:
    """Commit a discovery whose held-out split has `per_domain` prompts in each domain."""
    rows = []
    for d in domains:
        for i in range(per_domain):
            content = f"{d} question number {i}: explain something in a few words"
            rows.append({"prompt_id": f"{d}-{i:03d}", "source": "test", "domain": d,
                         "messages": json.dumps([{"role": "user", "content": content}]), "n_tokens": len(content)})  # fmt: skip
    table = pa.Table.from_pylist(sorted(rows, key=lambda r: r["prompt_id"]), schema=MANIFEST_SCHEMA)
    tables = {"manifest": table, "holdout": table, "quarantine": QUARANTINE_SCHEMA.empty_table(),
              "filtered": FILTERED_SCHEMA.empty_table()}  # fmt: skip
    commit_discovery(run, tables, {}, "", "test-config")
    return table


def encode(messages: list[dict[str, Any]]) -> list[int]:
    """A stand-in tokenizer: bytes of the last message's content, shifted past the specials."""
    return [4 + b % 200 for b in messages[-1]["content"].encode()][:48]


def emulated_speedup(launches: list[dict[str, Any]], config: str) -> float:
    """`config`'s tokens per second over the baseline's, from the emulator's own reported
    latencies (meta_info e2e_latency, timed around its sleep): no client, HTTP or scheduling
    time in them, so a loaded machine cannot shrink this ratio as it shrinks the wall-clock
    tok/s the decision uses. `launches` as in report.json (BenchResult.to_dict())."""

    def tok_s(name: str) -> float:
        requests = [r for x in launches for r in x["requests"] if r["config"] == name]
        assert requests and all(r["server_e2e_latency_s"] for r in requests), name
        return sum(r["completion_tokens"] for r in requests) / sum(r["server_e2e_latency_s"] for r in requests)

    return tok_s(config) / tok_s("baseline")
