"""The run's configuration: one pydantic model, `EagleScaleConfig`, loaded from a params YAML.

strict.py           the base of every model: unknown keys are errors
sections.py         the sections (target, discover, sampling, engine, generate, extract, train,
                    slack, orchestration), `EagleScaleConfig` and the `contradictions` it refuses
gate_section.py     the `gate` section: `GateConfig`, `SpecPoint`, `Challenger`
paths.py            the keys that name local paths (`PATH_KEYS`) and how each is made absolute
loading.py          `load_config`: a params file, `--set` overrides, a run root; `ConfigError`
input_checks.py     `check_input_paths`: the inputs the run reads exist, before anything starts

Below the stages: loading a configuration imports no stage code, only the SGLang launch checks
the gate section runs (tasks/sglang/) and the target's path helpers (tasks/target/path_kinds.py,
packages.py). The gate section's `server` is SGLang's own settings model
(tasks/sglang/server_settings.py), which the command builder below takes too. The names below are
the package's interface; the gate section is imported from its own module.
"""

from tasks.config.input_checks import check_input_paths
from tasks.config.loading import ConfigError, apply_overrides, load_config, parse_override
from tasks.config.paths import PATH_KEYS, PathKey, PathOrigin, is_url, resolve_paths
from tasks.config.sections import (
    STAGES,
    USER_TEMPLATE_PLACEHOLDER,
    ConversationFormat,
    DedupeKey,
    DiscoverConfig,
    DomainRule,
    EagleScaleConfig,
    EngineConfig,
    ExtractConfig,
    FileFormat,
    GenerateConfig,
    OrchestrationConfig,
    PromptTurns,
    SamplingConfig,
    ShardLeaseConfig,
    SlackConfig,
    SourceConfig,
    SourceKind,
    Stage,
    SystemTurns,
    TargetConfig,
    TrainConfig,
    contradictions,
)

__all__ = [
    "PATH_KEYS",
    "STAGES",
    "USER_TEMPLATE_PLACEHOLDER",
    "ConfigError",
    "ConversationFormat",
    "DedupeKey",
    "DiscoverConfig",
    "DomainRule",
    "EagleScaleConfig",
    "EngineConfig",
    "ExtractConfig",
    "FileFormat",
    "GenerateConfig",
    "OrchestrationConfig",
    "PathKey",
    "PathOrigin",
    "PromptTurns",
    "SamplingConfig",
    "ShardLeaseConfig",
    "SlackConfig",
    "SourceConfig",
    "SourceKind",
    "Stage",
    "SystemTurns",
    "TargetConfig",
    "TrainConfig",
    "apply_overrides",
    "check_input_paths",
    "contradictions",
    "is_url",
    "load_config",
    "parse_override",
    "resolve_paths",
]
