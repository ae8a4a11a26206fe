"""SGLang's adaptive-speculation config as eaglescale writes it: 0.5.14's rules on the file, the
tiers built from load levels, a batch's route to a tier, the vLLM schedule, and the launch flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.sglang.adaptive import (
    DEFAULT_TIERS,
    AdaptiveConfig,
    AdaptiveConfigError,
    pad_to_graph,
    spec_graph_batch_sizes,
    tiers_from_levels,
    vllm_schedule,
)
from tasks.sglang.command import LaunchSpec, build_server_args, resolve_spec
from tasks.sglang.versions import LaunchError


def test_a_policy_round_trips_through_its_json() -> None:
    tiers = tiers_from_levels({1: 3, 2: 3, 4: 3, 8: 2, 16: 0, 32: 0, 64: 0})
    assert tiers == {1: (3,), 5: (2,), 9: (0,)}
    config = AdaptiveConfig(tiers, {})
    raw = json.loads(json.dumps(config.to_json()))
    assert raw == {"1": {"candidate_steps": [3]}, "5": {"candidate_steps": [2]}, "9": {"candidate_steps": [0]}}
    assert AdaptiveConfig.parse(raw) == config
    assert config.candidate_steps == [0, 2, 3] and config.initial_num_steps() == 3


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({"bs8": {"candidate_steps": [3]}, "1": {"candidate_steps": [3]}}, "'bs8' is neither a batch-size tier"),
        ({"8 ": {"candidate_steps": [3]}}, "'8 ' is neither"),
        ({"1": {"candidate_steps": [3, -1]}}, "non-negative ints, got [3, -1]"),
        ({"1": {"candidate_steps": []}}, "non-empty list"),
        ({"1": {"candidate_steps": [True]}}, "non-negative ints"),
        ({"1": {"candidate_steps": "3"}}, "non-negative ints"),
        ({"ema_alpha": 0.2}, "no batch-size tier"),
        ({"1": {"candidate_steps": [3], "max_steps": 4}}, "unknown keys ['max_steps']"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_what_0514_refuses_or_would_silently_ignore_is_refused(raw: object, says: str) -> None:
    with pytest.raises(AdaptiveConfigError, match=None) as e:
        AdaptiveConfig.parse(raw, "policy.json")
    assert says in str(e.value) and str(e.value).startswith("policy.json")


def test_sglang_0514_defaults_and_knobs_parse() -> None:
    raw = {str(b): {"candidate_steps": list(s), "up_hysteresis": 0.0} for b, s in DEFAULT_TIERS.items()}
    config = AdaptiveConfig.parse({**raw, "ema_alpha": 0.3, "warmup_batches": 4})
    assert config.tiers == DEFAULT_TIERS and config.knobs == {"ema_alpha": 0.3, "warmup_batches": 4}
    assert config.candidate_steps == [0, 1, 3, 7] and config.initial_num_steps() == 7


def test_a_batch_pads_to_the_next_graph_size_then_takes_the_tier_at_or_below() -> None:
    sizes = spec_graph_batch_sizes(64)
    # 0.5.14's speculative capture list: 1..8, then by 2 to 32, by 4 to 64.
    assert sizes[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12] and sizes[-3:] == [56, 60, 64]
    assert spec_graph_batch_sizes(20)[-1] == 20 and 20 in spec_graph_batch_sizes(20)
    assert pad_to_graph(9, sizes) == 10 and pad_to_graph(100, sizes) == 100 and pad_to_graph(9, None) == 9
    config = AdaptiveConfig(tiers_from_levels({1: 3, 8: 3, 16: 0}), {})
    assert config.tiers == {1: (3,), 9: (0,)}
    assert [config.fixed_steps(b, sizes) for b in (1, 8, 9, 16, 64)] == [3, 3, 0, 0, 0]
    two = AdaptiveConfig({4: (3,), 32: (0, 1)}, {})
    # 29 pads to 30 (tier 4); 31 pads to 32, already the next tier.
    assert two.tier_for(1, sizes) == 4 and two.tier_for(29, sizes) == 4 and two.tier_for(31, sizes) == 32
    assert two.fixed_steps(40, sizes) is None  # two candidates: the server's EMA moves within them


def test_the_vllm_schedule_covers_every_batch_size_once() -> None:
    assert vllm_schedule({1: 3, 2: 3, 4: 3, 8: 1, 16: 0, 32: 0, 64: 0}, 64) == [[1, 4, 3], [5, 8, 1], [9, 64, 0]]
    assert vllm_schedule({1: 2}, 48) == [[1, 48, 2]]
    with pytest.raises(AdaptiveConfigError):
        tiers_from_levels({0: 3})


def _launch(tmp_path: Path, steps: int, topk: int = 1, tiers: object = None, version: str = "0.5.14") -> list[str]:
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(tiers if tiers is not None else {"1": {"candidate_steps": [3]}, "9": {"candidate_steps": [0]}}))
    spec, _ = resolve_spec("/drafts/d", steps, topk, None if topk == 1 else 8)
    return build_server_args(LaunchSpec("/models/t", 30000, spec=spec, adaptive_config=str(path)), version)


def test_the_launch_builder_emits_the_adaptive_flags_and_refuses_what_sglang_would(tmp_path: Path) -> None:
    args = _launch(tmp_path, 3)
    assert args[-3:] == ["--speculative-adaptive", "--speculative-adaptive-config", str(tmp_path / "adaptive.json")]
    with pytest.raises(LaunchError, match=r"--speculative-num-steps 2 is not one of the adaptive config's candidate steps \[0, 3\]"):
        _launch(tmp_path, 2)
    with pytest.raises(LaunchError, match="topk 4: SGLang 0.5.14 adapts chains"):
        _launch(tmp_path, 3, topk=4)
    with pytest.raises(LaunchError, match="SGLang 0.5.4 has no adaptive speculation"):
        _launch(tmp_path, 3, version="0.5.4")
    with pytest.raises(LaunchError, match="candidate_steps must be a non-empty list"):
        _launch(tmp_path, 3, tiers={"1": {"candidate_steps": [-3]}})
    with pytest.raises(LaunchError, match="needs speculative decoding"):
        build_server_args(LaunchSpec("/models/t", 30000, adaptive_config=str(tmp_path / "adaptive.json")), "0.5.14")
