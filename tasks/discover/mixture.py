"""Seeded selection: the per-domain holdout and the per-domain caps of the mixture.

Every choice is made over prompt ids sorted first and a `random.Random` seeded from the config
seed plus the purpose and domain, so the same prompts and seed give the same picks whatever order
the sources or their rows came in, and one domain's picks do not move when another domain changes.

Caps, per domain:
  - a `domain_quotas` entry is an exact cap (fewer when fewer are available);
  - otherwise, when `domain_weights` is set, the domain's weighted share of what `total_prompts`
    leaves after the quotas (largest-remainder rounding, so the shares sum exactly);
  - otherwise, when `total_prompts` is set, a share proportional to what the domain has;
  - otherwise no cap.
A domain short of its cap keeps what it has; the shortfall is reported, not moved elsewhere, so
the weights hold exactly for the domains that can meet them.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from fractions import Fraction

from tasks.config import ConfigError, DiscoverConfig
from tasks.discover.domains import declared_domains


class DiscoverConfigError(ConfigError):
    """A discover section that cannot work; the message names the field."""


def check_mixture_config(cfg: DiscoverConfig) -> None:
    domains = declared_domains(cfg)
    for field, table in (
        ("domain_quotas", cfg.domain_quotas),
        ("domain_weights", cfg.domain_weights),
    ):
        for name, value in table.items():
            if name not in domains:
                raise DiscoverConfigError(
                    f"discover.{field}: domain {name!r} is not the domain of any source or "
                    f"domain rule (domains: {domains})"
                )
            if value < 0:
                raise DiscoverConfigError(f"discover.{field}.{name}: must be >= 0 (got {value})")
    quota_sum = sum(cfg.domain_quotas.values())
    if cfg.total_prompts is not None and quota_sum > cfg.total_prompts:
        raise DiscoverConfigError(
            f"discover.domain_quotas: quotas sum to {quota_sum}, more than "
            f"discover.total_prompts ({cfg.total_prompts})"
        )
    if not cfg.domain_weights:
        return
    if cfg.total_prompts is None:
        raise DiscoverConfigError("discover.domain_weights needs discover.total_prompts")
    weighted = [d for d in domains if d not in cfg.domain_quotas]
    missing = [d for d in weighted if d not in cfg.domain_weights]
    if missing:
        raise DiscoverConfigError(
            f"discover.domain_weights: no weight (or quota) for domain(s) {missing}; "
            "give every source domain a weight, 0 to leave it out"
        )
    if weighted and sum(cfg.domain_weights[d] for d in weighted) <= 0:
        raise DiscoverConfigError("discover.domain_weights: weights sum to 0")


def seeded_pick(ids: Iterable[str], k: int, seed: int, purpose: str, domain: str) -> set[str]:
    """k ids chosen at random, reproducibly; all of them when there are no more than k."""
    ordered = sorted(ids)
    if k >= len(ordered):
        return set(ordered)
    return set(random.Random(f"{seed}:{purpose}:{domain}").sample(ordered, k))


def largest_remainder(budget: int, weights: Mapping[str, Fraction]) -> dict[str, int]:
    """Integer shares of `budget` in proportion to `weights`, summing to exactly `budget`."""
    total = sum(weights.values())
    if budget <= 0 or total <= 0:
        return dict.fromkeys(weights, 0)
    exact = {d: budget * w / total for d, w in weights.items()}
    shares = {d: int(x) for d, x in exact.items()}
    left = budget - sum(shares.values())
    by_remainder = sorted(exact, key=lambda d: (-(exact[d] - shares[d]), d))
    for d in by_remainder[:left]:
        shares[d] += 1
    return shares


def _fraction(weight: float) -> Fraction:
    # repr() is the shortest decimal that round-trips, so 0.3 becomes exactly 3/10.
    return Fraction(repr(float(weight)))


def domain_caps(cfg: DiscoverConfig, available: Mapping[str, int]) -> dict[str, int | None]:
    """Each domain's cap (None: keep all), given how many prompts each domain has left."""
    caps: dict[str, int | None] = {d: cfg.domain_quotas.get(d) for d in available}
    rest = sorted(d for d in available if d not in cfg.domain_quotas)
    if cfg.total_prompts is None or not rest:
        return caps
    budget = cfg.total_prompts - sum(cfg.domain_quotas.values())
    if cfg.domain_weights:
        weights = {d: _fraction(cfg.domain_weights[d]) for d in rest}
        caps.update(largest_remainder(budget, weights))
    elif sum(available[d] for d in rest) > budget:
        caps.update(largest_remainder(budget, {d: Fraction(available[d]) for d in rest}))
    return caps
