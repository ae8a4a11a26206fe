"""Params files: both shipped profiles load; unknown or ill-typed keys name the key and file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config import ConfigError, EagleScaleConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["smoke.yaml", "kimi-k25.yaml"])
def test_shipped_params_load(name):
    cfg = load_config(ROOT / "deployments" / "params" / name)
    assert isinstance(cfg, EagleScaleConfig)
    assert cfg.discover.sources


def test_kimi_profile_is_production_shaped():
    cfg = load_config(ROOT / "deployments/params/kimi-k25.yaml")
    assert cfg.run_root.startswith("s3://")
    assert cfg.engine.kind == "sglang" and len(cfg.engine.endpoints) >= 2
    assert cfg.discover.total_prompts == 83288


def test_unknown_key_names_key_and_file(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("run_root: /tmp/x\ntarget: {model_path: /m}\ngenerate: {shard_sise: 10}\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert f"{p}: unknown key 'generate.shard_sise'" in str(err.value)


def test_ill_typed_key_names_key(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("run_root: /tmp/x\ntarget: {model_path: /m}\nsampling: {max_new_tokens: lots}\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert "key 'sampling.max_new_tokens'" in str(err.value) and str(p) in str(err.value)


def test_overrides_apply_and_are_validated(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("run_root: /tmp/x\ntarget: {model_path: /m}\n")
    cfg = load_config(p, ["generate.shard_size=7", "engine.endpoints=[http://a:1/]"], run_root="/tmp/y")
    assert cfg.generate.shard_size == 7
    assert cfg.engine.endpoints == ["http://a:1"]
    assert cfg.run_root == "/tmp/y"
    with pytest.raises(ConfigError, match="unknown key 'engine.endpiont'"):
        load_config(p, ["engine.endpiont=x"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(p, ["engine.kind"])
