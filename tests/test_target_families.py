"""The target families' registry (tasks/target/families/): what it holds, the error for a
model_type it does not know, that the modules which used to hold per-family tables hold none,
and docs/TARGETS.md's "How to add a target family" walked through as written: its example
module registered in the way the page says, then used by the code that needs a family."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

from tasks.extract.capture import LayerIdError, aux_capture_layers, sglang_layers_to_capture
from tasks.target.errors import TargetError
from tasks.target.families import registry
from tasks.target.families.registry import UnknownTargetFamily, family_for, known_model_types

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "TARGETS.md"
# The modules that held what eaglescale knows about Llama and Qwen2 before the registry.
CONSUMERS = ["tasks/extract/capture.py", "tasks/draft/target_heads.py", "tasks/target/model_dir.py",
             "tasks/target/tokenizer.py", "tasks/target/gguf_convert.py", "tasks/gate/spec_engine_graphs.py"]  # fmt: skip


def test_the_registry_holds_the_shipped_families() -> None:
    assert {"llama", "qwen2", "qwen3", "deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v4", "gemma2"} <= set(known_model_types())
    assert registry.gguf_architectures() == ["llama", "qwen2", "qwen3"]
    assert family_for("kimi_k2") is family_for("deepseek_v3")  # an alias is the same family
    assert family_for("qwen3").static is not None and family_for("deepseek_v3").static is None
    assert {"smollm", "qwen2"} <= set(registry.gguf_pre_tokenizers())
    kimi = {"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2", "hidden_size": 8}}
    assert registry.language_config(kimi) == kimi["text_config"] and registry.config_model_type(kimi) == "kimi_k2"
    # A model_type no family knows keeps the usual nesting keys, so generation reads its shape.
    assert registry.language_config({"model_type": "x_vl", "llm_config": {"hidden_size": 8}}) == {"hidden_size": 8}


def test_an_unknown_model_type_names_the_known_ones_and_the_page() -> None:
    with pytest.raises(UnknownTargetFamily) as caught:
        family_for("mamba", "the local engine's static forward")
    message = str(caught.value)
    assert "model_type 'mamba' (the local engine's static forward)" in message
    assert "llama, " in message and "qwen3" in message and "docs/TARGETS.md says how to add one" in message
    assert isinstance(caught.value, TargetError)  # the CLI prints it without a traceback
    assert DOC.is_file() and "## How to add a target family" in DOC.read_text()
    with pytest.raises(UnknownTargetFamily, match="EAGLE-3's aux layers"):
        aux_capture_layers("mamba", 8)
    # Known, but SGLang's capture not read for it: no default ids, and it says so.
    with pytest.raises(LayerIdError, match="'gemma2': how SGLang captures"):
        aux_capture_layers("gemma2", 8)


def test_the_modules_that_held_family_tables_hold_none() -> None:
    """Adding a family touches its module and the registry's list: the consumers name no family."""
    names = sorted(set(known_model_types()) | set(registry.gguf_architectures()))
    found = {path: [n for n in names if re.search(rf"[\"']{re.escape(n)}[\"']", (ROOT / path).read_text())] for path in CONSUMERS}
    assert {path: n for path, n in found.items() if n} == {}


def _doc_module() -> types.ModuleType:
    """The example family module of docs/TARGETS.md, as the page writes it, as
    tasks/target/families/mistral.py would be imported."""
    text = DOC.read_text()
    section = text[text.index("## How to add a target family") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    source = "\n".join(line.removeprefix("   ") for line in code.group(1).splitlines())
    module = types.ModuleType("tasks.target.families.mistral")
    exec(compile(source, str(DOC), "exec"), module.__dict__)
    return module


@pytest.fixture
def mistral_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 2 and 3 of the page: the module in the families package, its name in the list."""
    monkeypatch.setitem(sys.modules, "tasks.target.families.mistral", _doc_module())
    monkeypatch.setattr(registry, "FAMILY_MODULES", (*registry.FAMILY_MODULES, "mistral"))


def _tiny_mistral(folder: Path) -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=None)  # fmt: skip
    model = MistralForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def test_the_page_s_example_family_is_picked_up_by_the_registry_and_used(
    mistral_registered: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tasks.draft.target_heads import load_target_heads
    from tasks.gate.spec_engine_graphs import StaticTarget

    family = family_for("mistral")
    assert family.architectures == ("MistralForCausalLM",) and family.tokenizer_kwargs == {}
    assert "mistral" in known_model_types() and aux_capture_layers("mistral", 32) == [1, 15, 28]
    assert sglang_layers_to_capture("mistral", [1, 15, 28]) == [2, 16, 29]
    model = _tiny_mistral(tmp_path / "mistral")
    embed, head = load_target_heads(str(tmp_path / "mistral"))
    assert torch.equal(embed, model.get_input_embeddings().weight) and torch.equal(head, model.lm_head.weight)
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(1))
    static = StaticTarget(model, [1, 3, 4], max_len=32)
    with torch.inference_mode():
        logits = torch.cat([static.forward(ids[:12], torch.arange(12))[0],
                            static.forward(ids[12:], torch.arange(12, 20))[0]])  # fmt: skip
        torch.testing.assert_close(logits, model(ids[None]).logits[0], atol=2e-4, rtol=1e-4)
    # Without step 3 it is unknown again, by the same message as any other.
    monkeypatch.setattr(registry, "FAMILY_MODULES", tuple(m for m in registry.FAMILY_MODULES if m != "mistral"))
    with pytest.raises(UnknownTargetFamily, match="model_type 'mistral' \\(the local engine's static forward\\)"):
        StaticTarget(model, [1, 3, 4], max_len=32)


def test_the_static_forward_refuses_what_its_family_does_not_describe(tmp_path: Path) -> None:
    """A model whose attention has per-head norms its family's StaticForward does not apply is
    refused, not run without them."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tasks.gate.spec_engine_graphs import StaticTarget

    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    model.config.model_type = "qwen2"  # a Qwen3 attention under Qwen2's family
    with pytest.raises(ValueError, match=r"has \['q_norm', 'k_norm'\], which its family module's StaticForward does not apply"):
        StaticTarget(model, [], max_len=16)
