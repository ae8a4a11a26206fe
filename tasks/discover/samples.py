"""The prompt set shipped with the package: the embedded default's sources."""

from __future__ import annotations

from pathlib import Path

from tasks.config import SourceConfig

SAMPLE_PROMPTS_DIR = Path(__file__).resolve().parent.parent / "data" / "sample_prompts"

# (file, domain); formats differ on purpose so the smoke run exercises the normalizers.
_SAMPLE_FILES = (
    ("agentic_coding.jsonl", "agentic_coding"),  # ShareGPT conversations
    ("reasoning.jsonl", "reasoning"),  # Alpaca rows and bare question rows
    ("general_chat.jsonl", "general_chat"),  # OpenAI messages
    ("malformed_examples.jsonl", "general_chat"),  # rows the quarantine must catch
)


def sample_prompt_sources(include_malformed: bool = True) -> list[SourceConfig]:
    """Sources for the shipped sample prompts, one per file, named after the file."""
    return [
        SourceConfig(name=Path(name).stem, path=str(SAMPLE_PROMPTS_DIR / name), domain=domain)
        for name, domain in _SAMPLE_FILES
        if include_malformed or not name.startswith("malformed")
    ]
