"""Which domain a row belongs to: its source's, unless one of the source's domain rules matches.

A rule is a regular expression searched in the user turns of the prompt as kept (not in earlier
answers, which would tag a chat as coding because the assistant once wrote code). The domains
rules can give are known from the config, so quotas and weights may name them.
"""

from __future__ import annotations

import re

from tasks.config import DiscoverConfig, SourceConfig
from tasks.discover.formats import Messages, user_turns


class DomainRules:
    def __init__(self, src: SourceConfig) -> None:
        self.default = src.domain
        self.rules = [(re.compile(r.pattern), r.domain) for r in src.domain_rules]

    def domain_of(self, messages: Messages) -> str:
        if not self.rules:
            return self.default
        text = "\n".join(m["content"] for m in user_turns(messages))
        for pattern, domain in self.rules:
            if pattern.search(text):
                return domain
        return self.default


# The configuration holds these rules (the config's own checks need them); these names are the
# discover stage's way in.


def source_domains(src: SourceConfig) -> list[str]:
    """The domains a source's rows can get: its own first, then its rules' in order."""
    return src.domains()


def declared_domains(cfg: DiscoverConfig) -> list[str]:
    """Every domain some row of the config can get, sorted."""
    return cfg.declared_domains()


def max_prompt_tokens(cfg: DiscoverConfig, domain: str | None = None) -> int:
    """The longest prompt `domain` keeps; with no domain, the longest any domain keeps."""
    return cfg.max_prompt_tokens_for(domain)


def max_prompt_setting(cfg: DiscoverConfig, domain: str) -> str:
    """The key and value that cap `domain`'s prompts, as a filtered row's detail names them."""
    return cfg.max_prompt_setting(domain)
