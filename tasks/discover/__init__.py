"""Stage `discover`: prompt sources -> a deduplicated, filtered, mixed prompt manifest."""

from tasks.discover.formats import (
    MalformedRow,
    RowOptions,
    canonical_json,
    normalize_row,
    normalized_hash,
    prompt_id_of,
)
from tasks.discover.mixture import DiscoverConfigError
from tasks.discover.pipeline import CountTokens, discover_prompts
from tasks.discover.result import (
    FILTERED_SCHEMA,
    MANIFEST_SCHEMA,
    QUARANTINE_SCHEMA,
    DiscoveryResult,
)
from tasks.discover.samples import SAMPLE_PROMPTS_DIR, sample_prompt_sources
from tasks.discover.sources import SourceError

__all__ = [
    "FILTERED_SCHEMA",
    "MANIFEST_SCHEMA",
    "QUARANTINE_SCHEMA",
    "SAMPLE_PROMPTS_DIR",
    "CountTokens",
    "DiscoverConfigError",
    "DiscoveryResult",
    "MalformedRow",
    "RowOptions",
    "SourceError",
    "canonical_json",
    "discover_prompts",
    "normalize_row",
    "normalized_hash",
    "prompt_id_of",
    "sample_prompt_sources",
]
