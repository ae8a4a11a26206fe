"""The one configuration model: the parent flow's parameter, loadable from YAML.

Every model forbids unknown keys, so a typo in a params file or in the Prefect UI form is an
error naming the key, never a silent default. Settings that contradict each other (servers for
the local engine, a topk sweep for an engine that drafts chains only) are refused the same way,
naming both keys, instead of one of them being ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from tasks.gate.config import GateConfig

STAGES = ("discover", "generate", "extract", "train", "gate")
Stage = Literal["discover", "generate", "extract", "train", "gate"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


ConversationFormat = Literal["auto", "openai", "sharegpt", "alpaca", "prompt"]
FileFormat = Literal["auto", "jsonl", "json", "parquet", "hf_disk"]


class SourceConfig(Strict):
    name: str = Field(description="Short name, used in the manifest's `source` column.")
    path: str = Field(description="Local path or fsspec URL of a file, a glob, or a datasets folder.")
    domain: str = Field(description="Domain tag, e.g. agentic_coding, reasoning, general_chat.")
    file_format: FileFormat = "auto"
    conversation_format: ConversationFormat = "auto"
    split: str | None = Field(None, description="Split to read from a DatasetDict folder.")
    max_rows: int | None = Field(None, ge=1, description="Read at most this many rows.")


class DiscoverConfig(Strict):
    sources: list[SourceConfig] = Field(default_factory=list)
    total_prompts: int | None = Field(
        None, ge=1, description="Target manifest size; with `domain_weights` sets each domain's quota."
    )
    domain_weights: dict[str, float] = Field(default_factory=dict)
    domain_quotas: dict[str, int] = Field(
        default_factory=dict, description="Exact per-domain caps; override weights."
    )
    holdout_per_domain: int = Field(
        8, ge=0, description="Prompts per domain split off as the gate's benchmark set."
    )
    min_prompt_tokens: int = Field(1, ge=0)
    max_prompt_tokens: int = Field(4096, ge=1)
    seed: int = 0


class TargetConfig(Strict):
    model_path: str = Field(description="HF model folder (local path or fsspec URL on GPU nodes).")
    revision: str | None = Field(None, description="Model revision; recorded in the fingerprint.")
    chat_template: str | None = Field(
        None, description="Jinja chat template overriding the tokenizer's own."
    )
    context_length: int | None = Field(None, ge=1)


class SamplingConfig(Strict):
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    max_new_tokens: int = Field(256, ge=1)
    samples_per_prompt: int = Field(1, ge=1)
    seed: int = 0


class EngineConfig(Strict):
    kind: Literal["local", "sglang"] = "local"
    # local (transformers in-process)
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    batch_size: int = Field(8, ge=1)
    # sglang (HTTP servers, or an sglang-router URL as a single endpoint)
    endpoints: list[str] = Field(default_factory=list)
    endpoint_kind: Literal["server", "router"] = Field(
        "server",
        description="server: SGLang servers; router: sglang-router URLs (health from /readiness, "
        "concurrency_per_server per healthy worker behind each).",
    )
    concurrency_per_server: int = Field(64, ge=1)
    request_timeout_s: float = Field(1800.0, gt=0)
    connect_timeout_s: float = Field(10.0, gt=0)
    max_attempts: int = Field(6, ge=1, description="Tries per request over transport errors.")
    backoff_base_s: float = Field(0.5, ge=0)
    backoff_max_s: float = Field(30.0, ge=0)
    unhealthy_after: int = Field(
        3, ge=1, description="Consecutive failures that take a server out of rotation."
    )
    health_recheck_s: float = Field(30.0, gt=0)

    @field_validator("endpoints")
    @classmethod
    def _strip_slash(cls, v: list[str]) -> list[str]:
        return [u.rstrip("/") for u in v]


class ShardLeaseConfig(Strict):
    """Shard lease timing of a stage that several workers may run on one run root."""

    lease_ttl_s: float = Field(
        120.0, gt=0, description="A shard lease without a heartbeat this long is taken over."
    )
    lease_heartbeat_s: float = Field(
        15.0, gt=0, description="How often a worker renews its shard leases (below the TTL)."
    )

    @model_validator(mode="after")
    def _heartbeat_below_ttl(self) -> ShardLeaseConfig:
        if self.lease_heartbeat_s >= self.lease_ttl_s:
            raise ValueError(
                f"lease_heartbeat_s ({self.lease_heartbeat_s}) must be below lease_ttl_s "
                f"({self.lease_ttl_s}), or a live worker's shards would be taken over"
            )
        return self


class GenerateConfig(ShardLeaseConfig):
    shard_size: int = Field(1000, ge=1, description="Prompts per shard (one Prefect task each).")
    max_parallel_shards: int = Field(2, ge=1)
    max_dead_fraction: float = Field(0.02, ge=0.0, le=1.0)
    journal_flush_s: float = Field(1.0, gt=0)
    progress_interval_s: float = Field(30.0, gt=0, le=60.0)
    stall_after_s: float = Field(900.0, gt=0)
    retry_dead: bool = Field(False, description="Rerun only the dead letters of committed shards.")
    shard_retries: int = Field(2, ge=0, description="Prefect retries of a failed shard task.")
    shard_retry_delay_s: float = Field(30.0, ge=0)


class ExtractConfig(ShardLeaseConfig):
    engine: Literal["local", "sglang"] = Field(
        "local", description="local: transformers in-process; sglang: SGLang's engine on a GPU node."
    )
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    batch_size: int = Field(4, ge=1, description="Sequences per forward pass.")
    max_length: int = Field(2048, ge=8, description="Tokens per training sequence; longer ones are truncated.")
    storage_dtype: Literal["bf16", "fp8_e4m3"] = Field(
        "bf16", description="Hidden-state storage; fp8 keeps a per-token scale and halves the bytes."
    )
    quota_bytes: int | None = Field(
        None, ge=1, description="Refuse when the forecast exceeds this (default: the free space)."
    )
    # Host memory holds about one part while a shard is extracted; 2 GiB stays far below
    # S3's 5 GB single PUT.
    part_bytes: int = Field(2 * 1024**3, ge=1, description="Bytes per extract data part.")
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Held-out split, per domain.")
    seed: int = 0


class TrainConfig(Strict):
    draft_vocab_size: int = Field(32000, ge=2, description="Capped at the target vocabulary.")
    ttt_steps: int = Field(7, ge=1, description="Training-time-test unroll length.")
    ttt_decay: float = Field(0.8, gt=0.0, le=1.0, description="Loss weight of step k is decay**k.")
    learning_rate: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(20, ge=0)
    max_steps: int | None = Field(None, ge=1, description="Default: `epochs` over the data.")
    epochs: int = Field(1, ge=1)
    batch_tokens: int = Field(4096, ge=8, description="Tokens per optimizer step (per process).")
    max_grad_norm: float = Field(0.5, gt=0.0)
    eval_every: int = Field(50, ge=1)
    save_every: int = Field(50, ge=1)
    logits_chunk: int = Field(1024, ge=1, description="Tokens per chunk of target-logit computation.")
    device: str = "cpu"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    nproc: int = Field(1, ge=1, description="Processes (GPUs) under torchrun.")
    intermediate_size: int | None = Field(None, ge=1, description="Default: the target's.")
    seed: int = 0


class SlackConfig(Strict):
    channel: str | None = None
    token_env: str = "SLACK_BOT_TOKEN"
    webhook_env: str = "SLACK_WEBHOOK_URL"
    secret_block: str | None = Field(
        None, description="Prefect Secret block holding a bot token or a webhook URL."
    )
    base_url: str | None = Field(None, description="Slack API base URL (tests point it locally).")


class OrchestrationConfig(Strict):
    stage_deployments: dict[Literal["generate", "extract", "train", "gate"], str] = Field(
        default_factory=dict,
        description="Stages run as their own deployments (\"flow/deployment\", e.g. on a GPU work "
        "pool) through run_deployment, so they show as child runs; the others run in-process.",
    )
    gpu_concurrency_limit: str | None = Field(
        None, description="Prefect global concurrency limit the GPU stages occupy while they run."
    )
    generate_runs_per_run_root: int | None = Field(
        None,
        ge=1,
        description="Generation runs allowed at once on one run root, held through a Prefect global "
        "concurrency limit (1: a second run fails naming the run root; N: N cooperating workers). "
        "None: no limit, shard leases alone keep workers apart.",
    )


class EagleScaleConfig(Strict):
    run_root: str = Field(description="Run folder: a local path or fsspec URL (s3://bucket/prefix).")
    stages: list[Stage] = Field(
        default_factory=lambda: list(STAGES)
    )
    target: TargetConfig
    discover: DiscoverConfig = Field(default_factory=DiscoverConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    slack: SlackConfig = Field(default_factory=SlackConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options for the run root (never secrets)."
    )
    allow_fingerprint_change: bool = Field(
        False, description="Resume even when run.json's fingerprint differs (dangerous)."
    )

    @model_validator(mode="after")
    def _no_contradictions(self) -> EagleScaleConfig:
        problems = contradictions(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self


def contradictions(cfg: EagleScaleConfig) -> list[str]:
    """Settings that one side of the configuration would silently ignore, each naming both keys.

    Only combinations that change what the run does are refused (servers that would never be
    asked, a sweep point that would never be measured); tuning knobs of the engine not chosen
    (timeouts, concurrency, tp_size) are left alone, so a profile can switch engines with one
    `--set`. `train.nproc > 1` on the CPU is not here: torchrun with gloo is a supported setup.
    """
    problems = []
    engine = cfg.engine
    if engine.kind == "local" and engine.endpoints:
        problems.append(
            f"engine.endpoints lists {engine.endpoints} but engine.kind is 'local': the local "
            "engine runs the target in this process and would never send them a request; set "
            "engine.kind: sglang to generate on those servers, or remove engine.endpoints"
        )
    if engine.kind == "sglang" and not engine.endpoints:
        problems.append(
            "engine.kind is 'sglang' but engine.endpoints is empty: there is no server to send "
            "requests to; list the servers in engine.endpoints (e.g. [http://HOST:30000]), or "
            "set engine.kind: local"
        )
    if engine.kind == "local" and engine.endpoint_kind == "router":
        problems.append(
            "engine.endpoint_kind is 'router' but engine.kind is 'local': only the sglang engine "
            "talks to a router; set engine.kind: sglang, or remove engine.endpoint_kind"
        )
    extract = cfg.extract
    if extract.engine == "sglang" and extract.device == "cpu":
        problems.append(
            "extract.engine is 'sglang' but extract.device is 'cpu': SGLang's engine runs on the "
            "node's GPU whatever extract.device says (it is read by the local engine and for the "
            "GPU slot the stage holds); set extract.device: cuda, or extract.engine: local"
        )
    gate = cfg.gate
    if gate.engine == "local":
        # Fields that every serialized config carries (a child deployment gets model_dump's
        # output), so "explicitly set" cannot be told from the default: the default topk_points
        # is SGLang's sweep, documented as skipped by the local engine; another list is a
        # request for points the local engine would not measure.
        default_points = GateConfig.model_fields["topk_points"].get_default(call_default_factory=True)
        points = [p for p in gate.topk_points if p.topk > 1]
        if points and gate.topk_points != default_points:
            problems.append(
                f"gate.topk_points asks for topk > 1 points ({[p.model_dump() for p in points]}) "
                "but gate.engine is 'local', which drafts chains (topk=1) only and would skip "
                "them; set gate.engine: sglang (or emulated), or gate.topk_points: []"
            )
        if gate.nccl_env_sweep != [{}]:
            problems.append(
                f"gate.nccl_env_sweep is {gate.nccl_env_sweep} but gate.engine is 'local': the "
                "in-process engine launches no server, so no environment would be applied or "
                "compared; set gate.engine: sglang (or emulated), or remove gate.nccl_env_sweep"
            )
    elif not gate.cuda_graphs:
        problems.append(
            f"gate.cuda_graphs is false but gate.engine is {gate.engine!r}: the flag is read by "
            "the local engine only, and the gate's SGLang launches always capture CUDA graphs "
            "(gate.require_cuda_graphs checks them); remove gate.cuda_graphs, or set "
            "gate.engine: local"
        )
    return problems


class ConfigError(ValueError):
    """A params file or override that does not fit the model; the message names key and file."""


def _format_errors(err: ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key '{key}'")
        elif not key:
            # A whole-config rule (contradictions): its message names the keys; the input would
            # be the entire config.
            message = e["msg"].removeprefix("Value error, ")
            lines += [f"{where}: {line}" for line in message.splitlines()]
        else:
            lines.append(f"{where}: key '{key}': {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value); the value is parsed as YAML (1, true, [x])."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"--set {text!r}: empty key")
    return key.strip().split("."), yaml.safe_load(raw) if raw else ""


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {text!r}: '{part}' is not a section")
            node = nxt
        node[path[-1]] = value
    return data


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    run_root: str | None = None,
) -> EagleScaleConfig:
    """Load a params YAML, apply `--set` overrides and an optional run root, validate."""
    data: dict[str, Any] = {}
    where = "<overrides>"
    if path is not None:
        where = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"{where}: params file not found") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"{where}: expected a mapping at the top level")
        data = loaded
    if overrides:
        data = apply_overrides(data, overrides)
        where = f"{where} (with --set {' '.join(overrides)})"
    if run_root is not None:
        data["run_root"] = run_root
    try:
        return EagleScaleConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, where)) from None
