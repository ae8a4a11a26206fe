"""The one configuration model: the parent flow's parameter, loadable from YAML.

Every model forbids unknown keys, so a typo in a params file or in the Prefect UI form is an
error naming the key, never a silent default. Settings that contradict each other (servers for
the local engine, a topk sweep for an engine that drafts chains only) are refused the same way,
naming both keys, instead of one of them being ignored.

Paths (PATH_KEYS) never depend on where a command starts: relative paths in a params file
resolve against the params file's folder, those given with `--set`/`--run-root` against the
working directory, and those that reach the model directly (a deployment's parameters, the
Prefect UI form, Python) against the working directory of the process that validates them
(for a deployment, the checkout its pull step moves to). URLs (`s3://`, `package://`, any
`scheme://`) and absolute paths are kept as written.
"""

from __future__ import annotations

import copy
import glob
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
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
    epochs: int = Field(1, ge=1, description="Passes over the training split (when max_steps is not set).")
    max_train_sequences: int | None = Field(
        None,
        ge=1,
        description="Train on the first N training sequences only (index order: shard, then request) "
        "and count the draft vocabulary over those: a smaller run on the same data, such as a first "
        "draft from 1k samples. The held-out split is unchanged. Default: all of them.",
    )
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
    hidden_states: Literal["offline", "online"] = Field(
        "offline",
        description="offline: train on the extract stage's stored states; online: the trainer runs "
        "the target (extract.dtype, on train.device) over each batch and stores none, and the parent "
        "flow skips the extract stage.",
    )
    seed: int = 0

    @field_validator("scaling_fractions")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        if any(not 0.0 < f < 1.0 for f in v) or len(set(v)) != len(v):
            raise ValueError(f"scaling_fractions must be distinct fractions in (0, 1), got {v}")
        return sorted(v)

    # The training recipe (issue 27): each choice a setting, today's behaviour the default. A
    # checkpoint records them and is not resumed with others (tasks/draft/recipe.py).
    adam_betas: tuple[float, float] = Field(
        (0.9, 0.95),
        description="AdamW's (beta1, beta2). SpecForge trains with torch's default (0.9, 0.999).",
    )
    loss_normalization: Literal["batch", "token"] = Field(
        "batch",
        description="batch: unroll step k's loss is decay**k times the mean over that batch's counted "
        "response tokens, so a token in a batch with few of them weighs more. token: every counted "
        "token weighs decay**k / batch_tokens, a fixed denominator, so each weighs the same in every "
        "batch and on every process; the gradient then scales with the batch's response share of its "
        "token budget (lower gradient norms than batch's, so max_grad_norm clips less often).",
    )
    init_lm_head_from_target: bool = Field(
        False,
        description="Start the draft's lm_head from the target's lm_head rows for the draft vocabulary "
        "(its embedding rows when the target ties them), as vLLM's speculators does. Default: random.",
    )
    freeze_lm_head: bool = Field(
        False,
        description="Keep the lm_head fixed (no gradient, not in the optimizer); needs "
        "init_lm_head_from_target.",
    )
    init_norm_from_target: bool = Field(
        False,
        description="Start the draft's final norm (applied before its lm_head) from the target's final "
        "norm weight instead of ones; it stays trainable.",
    )
    aux_state_noise: float = Field(
        0.0,
        ge=0.0,
        description="Standard deviation of Gaussian noise added to the target's aux hidden states in "
        "training steps (never in evaluation), absolute, in the states' own units as speculators' "
        "AddGaussianNoise (its default 0.05); seeded by train.seed and the step. 0: none.",
    )

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"adam_betas must both be in [0, 1), got {list(v)}")
        return v

    @model_validator(mode="after")
    def _frozen_head_starts_from_the_target(self) -> TrainConfig:
        if self.freeze_lm_head and not self.init_lm_head_from_target:
            raise ValueError("train.freeze_lm_head needs train.init_lm_head_from_target: a frozen head "
                             "would keep its random initialisation")
        return self


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
    overlap: bool = Field(
        False,
        description="Run extract alongside generate: extraction takes each generation shard as its "
        "marker appears and ends once generate/_COMPLETE is written and every marked shard is "
        "extracted. False: each stage starts when the one before it has ended.",
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
    # Where each path value came from (load_config only); never serialized.
    _path_origins: list[PathOrigin] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _absolute_paths(cls, data: Any, info: ValidationInfo) -> Any:
        # load_config has already resolved its file's paths against the file's folder; anything
        # else (a deployment's parameters, the UI form, Python) is relative to this process's
        # working directory, made explicit here so that it never changes meaning later (a
        # child deployment, a torchrun worker, a `cd`).
        if not isinstance(data, dict) or (info.context or {}).get(_RESOLVED):
            return data
        data = copy.deepcopy(data)
        base = Path.cwd()
        resolve_paths(data, lambda key: (base, "the working directory"))
        return data

    @model_validator(mode="after")
    def _no_contradictions(self) -> EagleScaleConfig:
        problems = contradictions(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def path_origins(self) -> list[PathOrigin]:
        """Each path value load_config resolved: the key, the value as written, its base."""
        return list(self._path_origins)


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
    if cfg.train.hidden_states == "online" and extract.engine == "sglang":
        problems.append(
            "train.hidden_states is 'online' but extract.engine is 'sglang': online, the trainer "
            "runs the target through transformers on train.device and no SGLang engine would "
            "capture anything; set extract.engine: local, or train.hidden_states: offline"
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


# ---- Paths --------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def looks_like_hub_id(value: str) -> bool:
    """`org/name`: a model_path that tasks/target.py looks up in the local HF cache when no such
    folder exists. `./x/y` and `.hidden/y` are paths (hub names never start with a dot)."""
    return bool(_HUB_ID.match(value)) and not value.startswith(".")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_GLOB_CHARS = "*?["
_RESOLVED = "eaglescale_paths_resolved"  # validation context: load_config resolved the paths


@dataclass(frozen=True)
class PathKey:
    key: str  # dotted; `name[]` walks the items of a list
    # input: must exist before the run; output: a stage makes it; optional: resolved, and a
    # missing one is the stage's to report (a challenger that is not there is left out, not fatal)
    role: Literal["input", "output", "optional"]
    what: str  # for messages


# Every config key that names a local file or folder: the one list path resolution, the
# pre-run existence check and deployments/sync_profiles.py's rebasing read.
PATH_KEYS: tuple[PathKey, ...] = (
    PathKey("run_root", "output", "run folder"),
    PathKey("target.model_path", "input", "model folder"),
    PathKey("target.chat_template", "input", "chat template file"),
    PathKey("discover.sources[].path", "input", "source file, glob or folder"),
    PathKey("gate.registry_url", "output", "registry folder"),
    PathKey("gate.python", "input", "Python interpreter"),
    PathKey("gate.challengers[].path", "optional", "challenger draft folder"),
)


def is_template_text(chat_template: str) -> bool:
    """target.chat_template holds a Jinja template itself, not the path of a file holding one."""
    return "{{" in chat_template or "{%" in chat_template


def is_url(value: str) -> bool:
    """`s3://...`, `package://...`, any `scheme://`: never rebased."""
    return bool(_SCHEME.match(value))


@dataclass(frozen=True)
class PathOrigin:
    """One path value as resolved: where it was written and what it was relative to."""

    key: str  # concrete key, e.g. discover.sources[1].path
    role: Literal["input", "output", "optional"]
    what: str
    value: str  # as resolved (absolute)
    given: str  # as written
    base: Path | None  # the folder a relative value was joined to (None: absolute as written)
    base_name: str  # e.g. "the folder of the params file x.yaml", "the working directory"
    hub_id: bool = False  # target.model_path kept as a hub id: no such folder under base


def _slots(data: Any, key: str) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(concrete key, the mapping that holds it, its name there) for each place `key` names."""
    parts = key.split(".")

    def walk(node: Any, i: int, prefix: str) -> Iterator[tuple[str, dict[str, Any], str]]:
        name = parts[i].removesuffix("[]")
        if not isinstance(node, dict) or name not in node:
            return
        here = f"{prefix}{name}"
        if i == len(parts) - 1:
            yield here, node, name
        elif parts[i].endswith("[]"):
            for j, item in enumerate(node[name] if isinstance(node[name], list) else []):
                yield from walk(item, i + 1, f"{here}[{j}].")
        else:
            yield from walk(node[name], i + 1, f"{here}.")

    yield from walk(data, 0, "")


def _is_local_path(spec: PathKey, value: str) -> bool:
    """Whether `value` of this key names a local path (else it is kept exactly as written)."""
    if not value or is_url(value):
        return False
    if spec.key == "target.chat_template" and is_template_text(value):
        return False
    # A bare command name is looked up on PATH.
    return not (spec.key == "gate.python" and "/" not in value)


def _is_hub_id(spec: PathKey, value: str, base: Path) -> bool:
    """`org/name` as target.model_path is a hub id unless such a folder exists under base."""
    return spec.key == "target.model_path" and looks_like_hub_id(value) and not (base / value).exists()


def resolve_paths(
    data: dict[str, Any], base_of: Callable[[str], tuple[Path, str]]
) -> list[PathOrigin]:
    """Make every relative local path in `data` (raw config, changed in place) absolute.

    `base_of(concrete key)` gives the folder a relative value of that key is relative to, and
    how to name it in messages. Returns where each local path value came from.
    """
    origins = []
    for spec in PATH_KEYS:
        for key, node, name in list(_slots(data, spec.key)):
            given = node[name]
            if not isinstance(given, str):
                continue  # pydantic names the wrong type
            base, base_name = base_of(key)
            if not _is_local_path(spec, given):
                continue
            if _is_hub_id(spec, given, base):
                origins.append(PathOrigin(key, spec.role, spec.what, given, given, base, base_name, True))
                continue
            expanded = os.path.expanduser(given)
            if os.path.isabs(expanded):
                origins.append(PathOrigin(key, spec.role, spec.what, expanded, given, None, base_name))
                continue
            value = os.path.normpath(base / expanded)
            node[name] = value
            origins.append(PathOrigin(key, spec.role, spec.what, value, given, base, base_name))
    return origins


def _covers(override: list[str], key: str) -> bool:
    """Whether an override of the dotted path `override` set (part of) the value at `key`."""
    parts = re.sub(r"\[\d+\]", "", key).split(".")
    n = min(len(parts), len(override))
    return parts[:n] == override[:n]


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
    """Load a params YAML, apply `--set` overrides and an optional run root, validate.

    Relative paths (PATH_KEYS) from the file resolve against the file's folder; those from an
    override or `run_root` against the working directory. The result holds absolute paths,
    so it means the same from any working directory, and `path_origins()` says how each
    was resolved (check_input_paths names both in its messages).
    """
    data: dict[str, Any] = {}
    where = "<overrides>"
    cwd = Path.cwd()
    file_base = cwd
    if path is not None:
        where = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"{where}: params file not found ({os.path.abspath(path)})") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"{where}: expected a mapping at the top level")
        data = loaded
        file_base = Path(os.path.abspath(path)).parent
    set_keys = [parse_override(text)[0] for text in overrides or []]
    if overrides:
        data = apply_overrides(data, overrides)
        where = f"{where} (with --set {' '.join(overrides)})"
    if run_root is not None:
        data["run_root"] = run_root
        set_keys.append(["run_root"])

    def base_of(key: str) -> tuple[Path, str]:
        if any(_covers(keys, key) for keys in set_keys):
            return cwd, "the working directory (a --set or --run-root value)"
        if path is None:
            return cwd, "the working directory"
        return file_base, f"the folder of the params file {path}"

    origins = resolve_paths(data, base_of)
    try:
        config = EagleScaleConfig.model_validate(data, context={_RESOLVED: True})
    except ValidationError as e:
        raise ConfigError(_format_errors(e, where)) from None
    config._path_origins = origins
    return config


def _describe(origin: PathOrigin) -> str:
    if origin.base is None:
        return f"{origin.given!r} as written"
    return f"{origin.given!r} relative to {origin.base_name}, {origin.base}"


def _input_problem(origin: PathOrigin) -> str | None:
    """Why an input path cannot be used, or None."""
    value = origin.value
    if origin.hub_id:
        # Only here is transformers imported (tasks.target): a hub id is rare next to a folder.
        from tasks.target import TargetError, resolve_model_dir

        try:
            resolve_model_dir(value)
        except TargetError:
            return (
                f"no model folder at {origin.base / value if origin.base else value}, and "
                f"{value!r} is no hub id in the local Hugging Face cache either"
            )
        return None
    if origin.key == "target.model_path":  # a folder
        return None if os.path.isdir(value) else f"no {origin.what} at {value}"
    if origin.key.startswith("discover.sources"):
        if any(ch in value for ch in _GLOB_CHARS):
            return None if glob.glob(value) else f"no file matches {value}"
        return None if os.path.exists(value) else f"no file or folder at {value}"
    if os.path.isfile(value):
        return None
    return f"no {origin.what} at {value}"


def _needs_locally(config: EagleScaleConfig, key: str) -> bool:
    """Whether the stages this process runs read the input at `key` (others run elsewhere)."""
    if key.startswith("discover.sources"):
        return "discover" in config.stages
    if key.startswith("gate."):
        gate_here = "gate" in config.stages and "gate" not in config.orchestration.stage_deployments
        # The interpreter launches SGLang servers (the only gate input checked before the run).
        return gate_here and (key != "gate.python" or config.gate.engine == "sglang")
    return True  # the target: the parent reads its tokenizer for the fingerprint, every stage uses it


def check_input_paths(config: EagleScaleConfig) -> None:
    """Refuse, before anything starts, input paths this process needs that do not exist.

    Names each missing path in its absolute form and what it was relative to. Paths the
    stages create (run_root, the registry) need not exist; URLs are left to the stage that
    opens them, except `package://` paths, which are looked up here (cheaply, no import).
    """
    from tasks.packages import PackagePathError, resolve_package_path

    problems = []
    for origin in config.path_origins():
        if origin.role != "input" or not _needs_locally(config, origin.key):
            continue
        problem = _input_problem(origin)
        if problem is not None:
            problems.append(f"{origin.key}: {problem} ({_describe(origin)})")
    for spec in (s for s in PATH_KEYS if s.role == "input"):
        for key, node, name in _slots(config.model_dump(), spec.key):
            value = node[name]
            if isinstance(value, str) and value.startswith("package://") and _needs_locally(config, key):
                try:
                    resolve_package_path(value)
                except PackagePathError as e:
                    problems.append(f"{key}: {e}")
    if problems:
        raise ConfigError("missing input paths:\n  - " + "\n  - ".join(problems))
