"""The sections of the run's configuration and the one model that holds them, `EagleScaleConfig`:
the parent flow's parameter, loadable from YAML (tasks/config/loading.py).

Every model forbids unknown keys, so a typo in a params file or in the Prefect UI form is an
error naming the key, never a silent default. Settings that contradict each other (servers for
the local engine, a topk sweep for an engine that drafts chains only) are refused the same way,
naming both keys, instead of one of them being ignored.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from tasks.config.gate_section import GateConfig
from tasks.config.paths import PATHS_RESOLVED, PathOrigin, resolve_paths
from tasks.config.strict import Strict

STAGES = ("discover", "generate", "extract", "train", "gate")
Stage = Literal["discover", "generate", "extract", "train", "gate"]

ConversationFormat = Literal["auto", "openai", "sharegpt", "alpaca", "prompt"]
FileFormat = Literal["auto", "jsonl", "json", "parquet", "hf_disk"]
PromptTurns = Literal["through_last_user", "first_user", "every_user"]
SystemTurns = Literal["keep", "drop"]
DedupeKey = Literal["conversation", "user_turns"]
SourceKind = Literal["file", "synthesized"]
# A synthesized source's name is part of its shard ids (file names in the run folder).
_SHARD_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# The settings of a file source that a synthesized source has no use for, and the reverse: set
# on the other kind, each is refused rather than silently ignored.
FILE_ONLY_KEYS = ("path", "file_format", "conversation_format", "split", "max_rows", "prompt_turns",
                  "user_template")  # fmt: skip
SYNTHESIS_KEYS = ("count", "seed", "system_prompt", "seed_text", "max_request_tokens", "temperature",
                  "top_p", "top_k")  # fmt: skip
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
    kind: SourceKind = Field(
        "file",
        description="file: prompts read from `path`. synthesized: prompts the target writes itself "
        "(the Magpie method): given its chat template up to the start of a user turn (after "
        "`system_prompt`, if set) and `seed_text`, it writes a user request; `count` of them, each "
        "seeded by (source, index), through the generation stage's shards before discovery reads "
        "them back and filters them (docs/PIPELINE.md#prompts-the-target-writes).",
    )
    path: str | None = Field(
        None,
        description="Local path or fsspec URL of a file, a glob, or a datasets folder; or "
        "`package://<import name>/<path>` for a file inside an installed Python package. Required "
        "for kind file; none for kind synthesized.",
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
        description="Which prompts a conversation gives. through_last_user: every turn up to the "
        "last user turn that has text (earlier answers stay as context; the answer to it and any "
        "trailing empty user turns are dropped). first_user: only the first user turn (and a "
        "system turn before it), the usual choice to regenerate multi-turn chats single-turn. "
        "every_user: one prompt per user turn that has text, each through that turn (earlier "
        "answers, the dataset's own, stay as context): a multi-turn chat gives one reply to "
        "regenerate per turn, and each counts as a row in the discovery funnel. A broken turn "
        "ends a row's prompts there (those before it stay); "
        "a held-out prompt takes its whole conversation out of training. In every mode "
        "assistant turns before the first user turn are dropped, and only the turns kept must "
        "have text.",
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

    # kind synthesized (every one refused on a file source)
    count: int | None = Field(
        None, ge=1, description="synthesized: prompts to write (slots 0..count-1, each its own request)."
    )
    seed: int = Field(
        0,
        description="synthesized: mixed into every slot's sampling seed; a resumed run writes the same "
        "prompts (another seed, other prompts).",
    )
    system_prompt: str | None = Field(
        None,
        description="synthesized: a system turn before the user turn the target writes; it steers the "
        "domain (\"You are an assistant that helps with Python code.\"). Kept in the prompt unless "
        "system_turns: drop. None: the template's own default, if any.",
    )
    seed_text: str | None = Field(
        None,
        description="synthesized: the start of the user turn, which the target continues (\"Write a "
        "Python function\"); the request is this text and the continuation. None: the target writes "
        "the whole request.",
    )
    max_request_tokens: int = Field(
        256,
        ge=1,
        description="synthesized: the most tokens the target may write for one request; a request "
        "that reaches it is cut, and dropped as truncated.",
    )
    temperature: float = Field(
        1.0, gt=0.0, description="synthesized: sampling temperature of the requests (Magpie: 1.0)."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="synthesized: nucleus sampling of the requests.")
    top_k: int = Field(-1, description="synthesized: top-k sampling of the requests; -1: off.")

    @model_validator(mode="after")
    def _kind_settings(self) -> SourceConfig:
        defaults = type(self).model_fields
        if self.kind == "file":
            if self.path is None:
                raise ValueError(f"source {self.name!r}: path is required (kind file)")
            stray = [k for k in SYNTHESIS_KEYS if getattr(self, k) != defaults[k].get_default()]
            if stray:
                raise ValueError(f"source {self.name!r}: {stray} are settings of kind synthesized, "
                                 "not of a file source; set kind: synthesized, or remove them")
            return self
        stray = [k for k in FILE_ONLY_KEYS if getattr(self, k) != defaults[k].get_default()]
        if stray:
            raise ValueError(f"source {self.name!r}: {stray} are settings of a file source; a "
                             "synthesized source reads no file: remove them")
        if self.count is None:
            raise ValueError(f"source {self.name!r}: count is required (kind synthesized): how many "
                             "prompts the target writes")
        if not _SHARD_SAFE_NAME.match(self.name):
            raise ValueError(f"source {self.name!r}: a synthesized source's name names its shards in the "
                             "run folder; use letters, digits, '_', '.' and '-' (at most 64)")
        return self

    def domains(self) -> list[str]:
        """The domains its rows can get: its own first, then its rules' in order."""
        return list(dict.fromkeys([self.domain, *(r.domain for r in self.domain_rules)]))

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
    holdout_from: str | None = Field(
        None,
        description="Keep an earlier run's held-out set, so that runs at different data scales "
        "are gated (and their scaling curves measured) on the same prompts: that run's root (its "
        "committed prompts/holdout.parquet) or a holdout parquet file, a local path or fsspec URL. "
        "The held-out prompts are exactly its prompts (by prompt_id, with its domains) and "
        "holdout_per_domain picks none; every copy of one and every other prompt of its "
        "conversation is filtered as contaminated. One no longer among this run's prompts is "
        "still held out as recorded, and the report warns. None: holdout_per_domain, seeded.",
    )
    min_prompt_tokens: int = Field(1, ge=0, description="Shorter prompts are filtered (too_short).")
    max_prompt_tokens: int = Field(4096, ge=1, description="Longer prompts are filtered (too_long).")
    max_prompt_tokens_by_domain: dict[str, int] = Field(
        default_factory=dict,
        description="A domain's own max_prompt_tokens, in place of the one above: longer prompts "
        "only where they pay (ShareGPT code's later turns run to 2,048 tokens). Each domain must be "
        "one a source or rule gives. extract.max_length should hold the longest prompt and its "
        "reply: extraction drops a prompt of max_length tokens or more and cuts a longer sequence.",
    )
    dedupe_key: DedupeKey = Field(
        "conversation",
        description="What makes two prompts duplicates (exact and normalized dedupe, and "
        "decontamination). conversation: every turn, so prompts that differ only by a system "
        "turn stay distinct; user_turns: the user turns only.",
    )
    seed: int = 0
    near_duplicate_threshold: float = Field(
        0.8,
        gt=0.0,
        le=1.0,
        description="Synthesized prompts only: one whose user text shares this Jaccard similarity "
        "of word 3-grams (MinHash-estimated, then measured) with a prompt kept before it, "
        "synthesized or real, is filtered as near_duplicate.",
    )
    holdout_near_threshold: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="Synthesized prompts only, strictly: one that shares this share of a held-out "
        "prompt's word 3-grams, or holds this share of its own in one, sharing at least 3 3-grams "
        "unless the smaller has fewer (the overlap coefficient, measured exactly against every "
        "held-out prompt), is filtered as near_holdout, so that no "
        "near-copy of the gate's prompts trains. At most near_duplicate_threshold.",
    )

    @model_validator(mode="after")
    def _holdout_stricter(self) -> DiscoverConfig:
        if self.holdout_near_threshold > self.near_duplicate_threshold:
            raise ValueError(
                f"discover.holdout_near_threshold ({self.holdout_near_threshold}) is above "
                f"discover.near_duplicate_threshold ({self.near_duplicate_threshold}): the held-out "
                "prompts are guarded at least as strictly as training prompts are deduplicated"
            )
        return self

    def declared_domains(self) -> list[str]:
        """Every domain some row of the config can get, sorted."""
        return sorted({d for src in self.sources for d in src.domains()})

    def synthesized(self) -> list[SourceConfig]:
        return [s for s in self.sources if s.kind == "synthesized"]

    def max_prompt_tokens_for(self, domain: str | None = None) -> int:
        """The longest prompt `domain` keeps (its own cap, else the run's); with no domain, the
        longest any domain keeps (what a sequence's length is bounded by)."""
        if domain is None:
            return max([self.max_prompt_tokens, *self.max_prompt_tokens_by_domain.values()])
        return self.max_prompt_tokens_by_domain.get(domain, self.max_prompt_tokens)

    def max_prompt_setting(self, domain: str) -> str:
        """The key and value that cap `domain`'s prompts, as messages name them."""
        if domain in self.max_prompt_tokens_by_domain:
            return f"max_prompt_tokens_by_domain.{domain} {self.max_prompt_tokens_by_domain[domain]}"
        return f"max_prompt_tokens {self.max_prompt_tokens}"


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
    max_new_tokens_by_domain: dict[str, int] = Field(
        default_factory=dict,
        description="A domain's own max_new_tokens, in place of the one above: replies sized to "
        "what they need (1,024-2,048 for code, where 256 cut 55% of them). Each domain must be one a "
        "source or rule gives; extract.max_length must then hold each domain's longest prompt and "
        "reply (checked when the config loads).",
    )
    samples_per_prompt: int = Field(1, ge=1)
    seed: int = 0

    @field_validator("max_new_tokens_by_domain")
    @classmethod
    def _positive_caps(cls, v: dict[str, int]) -> dict[str, int]:
        bad = {d: n for d, n in v.items() if n < 1}
        if bad:
            raise ValueError(f"max_new_tokens_by_domain: caps must be >= 1, got {bad}")
        return v

    def max_new_tokens_for(self, domain: str | None = None) -> int:
        """The reply cap of `domain` (its own, else the run's); with no domain, the largest."""
        if domain is None:
            return max([self.max_new_tokens, *self.max_new_tokens_by_domain.values()])
        return self.max_new_tokens_by_domain.get(domain, self.max_new_tokens)


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
    reuse_from: str | None = Field(
        None,
        description="An earlier run's root (local path or fsspec URL) whose committed generation "
        "rows are reused for the same prompts instead of generated again: a grown prompt set "
        "(e.g. ShareGPT every_user after first_user) sends only its new prompts. Its run.json must "
        "record this run's target and sampling (else refused before any request, naming each "
        "differing field) and it must hold a committed generation shard. Reused rows are "
        "journaled here under an attempt named reused-<its fingerprint hash>-..., and counted as "
        "reused, not sent, in progress.json and the summary. None: every request is generated.",
    )


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
    holdout_unit: Literal["conversation", "prompt"] = Field(
        "conversation",
        description="What the held-out split holds out whole. conversation: every prompt of a held-out "
        "prompt's conversation (those that open alike), so that with a prompt per user turn "
        "(discover's prompt_turns every_user) no other turn of a held-out conversation trains. prompt: "
        "each prompt alone, the split of runs trained before this key (their draft's gate and resume "
        "need it). Runs of first-turn prompts get the same split from both.",
    )
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
    eval_cache_gib: float = Field(
        16.0,
        gt=0.0,
        description="Host memory for the held-out batches kept between evaluations (in compute_dtype; "
        "page-locked on a GPU). Past it, each evaluation reads them again (online: the target captures "
        "them again): slower, same figures. The held-out split grows with the data (extract.eval_fraction).",
    )
    save_every: int = Field(50, ge=1)
    time_budget_s: float | None = Field(
        None,
        gt=0,
        description="Seconds the train stage may train (the run's draft, then its scaling drafts): at each "
        "checkpoint, when the next one (every save_every steps, or the last step) would come past it at "
        "the pace measured so far, training stops there, exports nothing and the stage says so; the next "
        "run resumes that checkpoint exactly. The first checkpoint is always reached. null: no limit.",
    )
    min_target_agreement: float | None = Field(
        0.85,
        ge=0.0,
        le=1.0,
        description="For replies sampled at temperature 0: the least share of their response tokens that "
        "must be the target's own argmax, checked on the held-out sequences at the untrained evaluation, "
        "before the first step (the target's greedy replies agree at ~99%, another model's ~75%: "
        "BENCHMARKS P29). Below it beyond its sampling noise, training stops: the servers served other weights. null: no check "
        "(replies from another model on purpose).",
    )
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
    forecast_full_draft: bool = Field(
        False,
        description="Pre-register the full draft's accept length: train the scaling drafts first (on the "
        "full draft's vocabulary map and split, recorded before any of them), fit their held-out accept "
        "lengths against log(samples), write the forecast at the full training split to "
        "train/forecast.json, then train the full draft, whose train/result.json names the forecast's "
        "content hash; train/forecast-check.json sets the full draft's own held-out accept lengths beside it. "
        "Needs two or more scaling_fractions.",
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

    # The training recipe (issue 27): each choice a setting. The defaults are the recipe trained
    # before the settings existed except where the H200's A/B measured better (BENCHMARKS P11):
    # adam_betas. A checkpoint records them and is not resumed with others (tasks/draft/recipe.py).
    adam_betas: tuple[float, float] = Field(
        (0.9, 0.999),
        description="AdamW's (beta1, beta2): torch's default, as SpecForge trains. The default was once "
        "(0.9, 0.95); (0.9, 0.999) accepted 1.1% more at 3 steps on the same data and "
        "steps (held-out replay, paired CI +0.3%..+1.8%, BENCHMARKS P11).",
    )
    objective: str = Field(
        "soft_ce",
        description="The loss each counted row is trained on, by name (tasks/draft/objectives.py OBJECTIVES; "
        "docs/TRAINING.md says how to add one): soft_ce, cross-entropy against the target's distribution over "
        "the draft vocabulary (EAGLE-3's). An unknown name is refused before any data is read.",
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

    init_from: str | None = Field(
        None,
        description="An exported draft to start from instead of random weights (a train stage's "
        "final/, or a registry's promoted draft; SGLang or speculators format): a draft shipped on "
        "less data, continued on more. It must have been made for this target with this run's "
        "draft_vocab_size and intermediate_size (every difference is named before any work), and "
        "its vocabulary map becomes the run's. Checkpoints record its weights' sha256: a resume "
        "from another start is refused. Not with init_lm_head_from_target or init_norm_from_target, "
        "nor with scaling_fractions.",
    )

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"adam_betas must both be in [0, 1), got {list(v)}")
        return v

    @model_validator(mode="after")
    def _frozen_head_starts_from_the_target(self) -> TrainConfig:
        if self.freeze_lm_head and not (self.init_lm_head_from_target or self.init_from):
            raise ValueError("train.freeze_lm_head needs train.init_lm_head_from_target (or train.init_from): "
                             "a frozen head would keep its random initialisation")
        if self.init_from and (self.init_lm_head_from_target or self.init_norm_from_target):
            raise ValueError("train.init_from starts every weight from that draft: train.init_lm_head_from_target "
                             "and train.init_norm_from_target would overwrite its head or norm; leave them off")
        if self.forecast_full_draft and len(self.scaling_fractions) < 2:
            raise ValueError(f"train.forecast_full_draft fits a curve to the scaling drafts: it needs two or more "
                             f"train.scaling_fractions, got {self.scaling_fractions}")  # fmt: skip
        if self.init_from and self.scaling_fractions:
            raise ValueError("train.init_from with train.scaling_fractions: the scaling drafts measure what data "
                             "alone buys, from random weights, and a continued draft is no point of that curve; "
                             "leave one of them out")
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
        if not isinstance(data, dict) or (info.context or {}).get(PATHS_RESOLVED):
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
    problems = _reply_problems(cfg)
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


# Room for what a chat template writes after a reply that the reply itself does not end with (the
# turn terminator: 1 or 2 tokens for the templates eaglescale knows), so that it is trained too.
TERMINATOR_ROOM = 8


def _reply_problems(cfg: EagleScaleConfig) -> list[str]:
    """sampling.max_new_tokens_by_domain asks for replies to their end: refuse a domain no source
    gives, and an extract.max_length that would cut a domain's longest prompt and reply."""
    caps = cfg.sampling.max_new_tokens_by_domain
    if not caps:
        return []  # runs sized before the key keep their max_length (extraction counts the cuts)
    domains = cfg.discover.declared_domains()
    problems = [
        f"sampling.max_new_tokens_by_domain: domain {d!r} is not the domain of any source or domain "
        f"rule (domains: {domains})"
        for d in caps if d not in domains
    ]
    for domain in domains:
        prompt = cfg.discover.max_prompt_tokens_for(domain)
        reply = cfg.sampling.max_new_tokens_for(domain)
        need = prompt + reply + TERMINATOR_ROOM
        if cfg.extract.max_length < need:
            reply_key = (f"sampling.max_new_tokens_by_domain.{domain}" if domain in caps
                         else "sampling.max_new_tokens")  # fmt: skip
            problems.append(
                f"extract.max_length ({cfg.extract.max_length}) cuts domain {domain!r}'s longest "
                f"sequence: discover.{cfg.discover.max_prompt_setting(domain)} + {reply_key} {reply} "
                f"+ {TERMINATOR_ROOM} for the turn terminator = {need} tokens; set extract.max_length "
                f"to at least {need}, or lower one of the two caps"
            )
    return problems
