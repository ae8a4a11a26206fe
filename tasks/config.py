"""The one configuration model: the parent flow's parameter, loadable from YAML.

Every model forbids unknown keys, so a typo in a params file or in the Prefect UI form is an
error naming the key, never a silent default.
"""

from __future__ import annotations

import re
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
PromptTurns = Literal["through_last_user", "first_user"]
SystemTurns = Literal["keep", "drop"]
DedupeKey = Literal["conversation", "user_turns"]
# The one placeholder of `SourceConfig.user_template`; any other `{name}` is refused as a typo.
USER_TEMPLATE_PLACEHOLDER = "{prompt}"
_TEMPLATE_FIELD = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")


class DomainRule(Strict):
    pattern: str = Field(
        description="Python regular expression searched (re.search) in the user turns of the "
        "prompt as kept, joined by newlines; `(?i)` makes it case-insensitive."
    )
    domain: str = Field(description="Domain given to the rows whose user text matches.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"pattern {v!r} is not a valid regular expression: {e}") from None
        return v


class SourceConfig(Strict):
    name: str = Field(description="Short name, used in the manifest's `source` column.")
    path: str = Field(
        description="Local path or fsspec URL of a file, a glob, or a datasets folder; or "
        "`package://<import name>/<path>` for a file inside an installed Python package."
    )
    domain: str = Field(
        description="Domain tag, e.g. agentic_coding, reasoning, general_chat; the domain of "
        "every row that no `domain_rules` entry matches."
    )
    file_format: FileFormat = Field(
        "auto", description="auto: from the extension (.jsonl, .json, .parquet, + .gz/.bz2/.xz/.zst)."
    )
    conversation_format: ConversationFormat = Field(
        "auto", description="Row shape; auto: from the fields of each row."
    )
    split: str | None = Field(None, description="Split to read from a DatasetDict folder.")
    max_rows: int | None = Field(None, ge=1, description="Read at most this many rows.")
    prompt_turns: PromptTurns = Field(
        "through_last_user",
        description="Which prompt a conversation gives. through_last_user: every turn up to the "
        "last user turn that has text (earlier answers stay as context; the answer to it and any "
        "trailing empty user turns are dropped). first_user: only the first user turn (and a "
        "system turn before it), the usual choice to regenerate multi-turn chats single-turn. "
        "Either way assistant turns before the first user turn are dropped, and only the turns "
        "kept must have text.",
    )
    system_turns: SystemTurns = Field(
        "keep",
        description="keep: system turns stay in the prompt; drop: they are removed (ShareGPT's "
        "are share-tool banners, not instructions). Empty system turns are always removed.",
    )
    min_latin_fraction: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Script filter: rows whose prompt text (all turns kept) has a smaller "
        "fraction of Latin-script letters among its letters are filtered as non_latin. A prompt "
        "with no letters at all passes. None: no filter.",
    )
    domain_rules: list[DomainRule] = Field(
        default_factory=list,
        description="Rows whose user text matches a rule's pattern get the rule's domain instead "
        "of `domain`; the first matching rule wins.",
    )
    user_template: str | None = Field(
        None,
        description="For conversation_format prompt: the user turn's text, with `{prompt}` "
        "(exactly once) replaced by the row's prompt, e.g. \"Complete the following Python "
        "function:\\n\\n```python\\n{prompt}```\". None: the prompt as is.",
    )

    @field_validator("user_template")
    @classmethod
    def _one_placeholder(cls, v: str | None) -> str | None:
        if v is None:
            return v
        found = _TEMPLATE_FIELD.findall(v)
        others = sorted({f for f in found if f != USER_TEMPLATE_PLACEHOLDER})
        if others:
            raise ValueError(
                f"user_template has placeholder(s) {others}; the only placeholder is "
                f"{USER_TEMPLATE_PLACEHOLDER}"
            )
        if len(found) != 1:
            raise ValueError(
                f"user_template must contain {USER_TEMPLATE_PLACEHOLDER} exactly once "
                f"(found {len(found)} times)"
            )
        return v

    @model_validator(mode="after")
    def _template_needs_prompt_format(self) -> SourceConfig:
        if self.user_template is not None and self.conversation_format != "prompt":
            raise ValueError(
                f"user_template is set but conversation_format is {self.conversation_format!r}; "
                "it applies to conversation_format prompt only (set it explicitly)"
            )
        return self


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
    min_prompt_tokens: int = Field(1, ge=0, description="Shorter prompts are filtered (too_short).")
    max_prompt_tokens: int = Field(4096, ge=1, description="Longer prompts are filtered (too_long).")
    dedupe_key: DedupeKey = Field(
        "conversation",
        description="What makes two prompts duplicates (exact and normalized dedupe, and "
        "decontamination). conversation: every turn, so prompts that differ only by a system "
        "turn stay distinct; user_turns: the user turns only.",
    )
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
    scaling_fractions: list[float] = Field(
        default_factory=list,
        description="Data-scaling curve: after the full draft, train one more draft on each of these "
        "fractions of the training split (e.g. [0.1, 0.3]), exported to train/scaling/; the gate "
        "replays and measures each beside the full one and plots acceptance against samples.",
    )
    seed: int = 0

    @field_validator("scaling_fractions")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        if any(not 0.0 < f < 1.0 for f in v) or len(set(v)) != len(v):
            raise ValueError(f"scaling_fractions must be distinct fractions in (0, 1), got {v}")
        return sorted(v)


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


class ConfigError(ValueError):
    """A params file or override that does not fit the model; the message names key and file."""


def _format_errors(err: ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key '{key}'")
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
