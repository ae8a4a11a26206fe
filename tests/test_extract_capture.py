"""Hidden-state capture on the tiny target: the layer-id convention, HF parity, batch
independence, decode-time parity, the storage format (bf16 and the fp8 bound), and the
SGLang backend's testable parts."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tasks.extract.capture import (
    LayerIdError,
    aux_capture_layers,
    sglang_layers_to_capture,
    validate_aux_layer_ids,
)
from tasks.extract.local_capture import CapturedStates, LocalCapture, decode_capture
from tasks.extract.sequences import TrainingSequence
from tasks.extract.sglang_capture import (
    SGLANG_MISSING,
    SGLangCapture,
    check_capture_draft,
    engine_kwargs,
    generate_request,
    import_sglang,
    parse_hidden_states,
)
from tasks.extract.storage import (
    ExtractFormatError,
    ShardWriter,
    bytes_per_token,
    decode_extract_shard,
    quantize_fp8,
    shard_metadata,
    verify_shard,
)

IDS = [1, 3, 4]
H = 64


@pytest.fixture(scope="module")
def model(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), local_files_only=True).eval()


def _seqs(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            10, 2000, (int(torch.randint(3, 40, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(n)
    ]


def test_layer_id_convention_is_sglangs():
    assert aux_capture_layers("llama", 8) == [1, 3, 4]
    assert aux_capture_layers("llama", 61) == [1, 29, 57]
    # SGLang logs this as capturing [2, 30, 58]: the inputs of the next layers.
    assert sglang_layers_to_capture("llama", [1, 29, 57]) == [2, 30, 58]
    # DeepSeek-V2/V3 (Kimi-K2) apply the same +1 and capture the same tensors.
    assert aux_capture_layers("deepseek_v3", 61) == [1, 29, 57]
    assert sglang_layers_to_capture("deepseek_v3", [1, 29, 57]) == [2, 30, 58]
    # DeepSeek-V4 captures after the layer (no +1) and has no default.
    assert sglang_layers_to_capture("deepseek_v4", [1, 29, 57]) == [1, 29, 57]
    with pytest.raises(LayerIdError, match="explicit"):
        aux_capture_layers("deepseek_v4", 61)
    with pytest.raises(LayerIdError, match=r"ids \[7\] outside \[0, 6\]"):
        validate_aux_layer_ids("llama", [1, 3, 7], 8)  # layer 8's input does not exist
    with pytest.raises(LayerIdError, match="distinct"):
        aux_capture_layers("llama", 6)  # [1, 2, 2]


def test_captured_aux_states_are_hf_hidden_states_of_the_next_index(model):
    seqs = _seqs(5)
    out = LocalCapture(model, IDS, batch_size=2).capture(seqs)
    with torch.no_grad():
        for seq, states in zip(seqs, out, strict=True):
            hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
            want = torch.cat([hs[i + 1] for i in IDS], dim=-1)[0]
            assert states.aux.shape == (len(seq), 3 * H)
            torch.testing.assert_close(states.aux, want, rtol=0, atol=1e-5)
            # The output of the last layer after the final norm.
            torch.testing.assert_close(states.last, hs[-1][0], rtol=0, atol=1e-5)
            # Not off by one: the neighbouring layers' states differ.
            assert (states.aux[:, :H] - hs[1][0]).abs().max() > 1e-2


def test_states_do_not_depend_on_batch_composition(model):
    seqs = _seqs(7, seed=1)
    alone = LocalCapture(model, IDS, batch_size=1).capture(seqs)
    for batch_size in (3, 7):
        batched = LocalCapture(model, IDS, batch_size=batch_size).capture(seqs)
        for a, b in zip(alone, batched, strict=True):
            torch.testing.assert_close(b.aux, a.aux, rtol=0, atol=1e-5)
            torch.testing.assert_close(b.last, a.last, rtol=0, atol=1e-5)


def test_decode_time_capture_matches_whole_sequence_capture(model):
    prompt = _seqs(1, seed=2)[0]
    decoded = decode_capture(model, prompt, IDS, max_new_tokens=12)
    assert len(decoded.token_ids) == len(prompt) + 12 and decoded.finish_reason == "length"
    whole = LocalCapture(model, IDS).capture([decoded.token_ids])[0]
    assert decoded.aux.shape == whole.aux.shape == (len(decoded.token_ids), 3 * H)
    torch.testing.assert_close(decoded.aux, whole.aux, rtol=0, atol=1e-5)
    torch.testing.assert_close(decoded.last, whole.last, rtol=0, atol=1e-5)
    forced = decode_capture(
        model, prompt, IDS, max_new_tokens=0, forced_ids=decoded.token_ids[len(prompt) :]
    )
    assert forced.token_ids == decoded.token_ids
    torch.testing.assert_close(forced.aux, decoded.aux, rtol=0, atol=1e-6)


def _shard(storage_dtype: str, states: list[CapturedStates]) -> tuple[bytes, ShardWriter]:
    writer = ShardWriter(H, IDS, storage_dtype)
    for i, st in enumerate(states):
        n = st.aux.shape[0]
        seq = TrainingSequence(
            f"r{i:03d}",
            f"p{i}",
            "general_chat",
            "eval" if i % 2 else "train",
            list(range(n)),
            [0] * (n // 2) + [1] * (n - n // 2),
            False,
        )
        writer.add(seq, st)
    return writer.to_bytes(), writer


def _random_states(n: int) -> list[CapturedStates]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        t = 3 + 7 * i
        # Per-token scales spread over six decades, plus an all-zero token.
        scale = 10 ** torch.empty(t, 1).uniform_(-3, 3, generator=gen)
        aux = torch.randn(t, 3 * H, generator=gen) * scale
        aux[0] = 0
        out.append(CapturedStates(aux, torch.randn(t, H, generator=gen) * scale))
    return out


def test_storage_layout_is_the_contract():
    states = _random_states(4)
    data, _ = _shard("bf16", states)
    meta = shard_metadata(data)
    assert meta == {
        "format_version": "1",
        "storage_dtype": "bf16",
        "hidden_size": H,
        "aux_layer_ids": IDS,
        "sequence_ids": ["r000", "r001", "r002", "r003"],
        "domains": ["general_chat"] * 4,
        "splits": ["train", "eval", "train", "eval"],
    }
    from safetensors.torch import load

    tensors = load(bytes(data))  # safetensors itself reads what the writer wrote
    assert {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()} == {
        "input_ids": (torch.int32, (54,)),
        "loss_mask": (torch.uint8, (54,)),
        "seq_offsets": (torch.int64, (5,)),
        "aux_hidden": (torch.bfloat16, (54, 3 * H)),
        "last_hidden": (torch.bfloat16, (54, H)),
    }
    back = decode_extract_shard(data)
    for st, seq in zip(states, back, strict=True):
        assert seq.aux_hidden.dtype == torch.float32 and seq.input_ids.dtype == torch.int64
        assert seq.loss_mask.dtype == torch.bool
        # bf16 keeps 8 significant bits: relative error at most 2^-9 per element.
        assert bool(((seq.aux_hidden - st.aux).abs() <= st.aux.abs() * 2**-8).all())
    with pytest.raises(ExtractFormatError, match="seq_offsets"):
        _corrupt_offsets(data)
    assert verify_shard(data) == meta["sequence_ids"]

    writer = ShardWriter(H, IDS, "bf16")
    no_loss = TrainingSequence("r-empty", "p", "d", "train", [1, 2, 3], [0, 0, 0], False)
    writer.add(no_loss, CapturedStates(torch.zeros(3, 3 * H), torch.zeros(3, H)))
    with pytest.raises(ExtractFormatError, match="r-empty"):
        verify_shard(writer.to_bytes())
    with pytest.raises(ValueError, match=r"sequence r-bad: .*expected \(2, 192\)"):
        writer.add(TrainingSequence("r-bad", "p", "d", "train", [1, 2], [1, 1], False), states[0])


def _corrupt_offsets(data: bytes) -> None:
    from safetensors.torch import load, save

    tensors = load(bytes(data))
    tensors["seq_offsets"][2] = 10_000
    decode_extract_shard(
        save(
            tensors,
            metadata={
                k: json.dumps(v) if isinstance(v, list) else str(v)
                for k, v in shard_metadata(data).items()
            },
        )
    )


def test_fp8_round_trip_error_is_bounded_and_halves_the_bytes():
    states = _random_states(6)
    bf16, _ = _shard("bf16", states)
    fp8, writer = _shard("fp8_e4m3", states)
    back = decode_extract_shard(fp8)
    for st, seq in zip(states, back, strict=True):
        for ref, got, groups in ((st.aux, seq.aux_hidden, 3), (st.last, seq.last_hidden, 1)):
            amax = ref.reshape(ref.shape[0], groups, -1).abs().amax(-1)
            bound = (amax / 28).repeat_interleave(ref.shape[1] // groups, dim=1)
            # Stated bound: half a step of e4m3's top binade, amax/28, per element.
            assert bool(((got - ref).abs() <= bound * (1 + 1e-6)).all())
        assert bool((seq.aux_hidden[0] == 0).all())
    report = writer.error_report()
    assert 0 < report["aux"]["rel_rms"] < 0.04 and 0 < report["last"]["rel_rms"] < 0.04
    ref = torch.cat([s.aux for s in states])
    got = torch.cat([s.aux_hidden for s in back])
    assert math.isclose(
        report["aux"]["rel_rms"], float((got - ref).norm() / ref.norm()), rel_tol=1e-4
    )
    assert len(fp8) / len(bf16) < 0.56
    assert bytes_per_token(7168, "bf16") == 8 * 7168 + 5  # 57 KB a token for Kimi-K2.5
    assert bytes_per_token(7168, "fp8_e4m3") == 4 * 7168 + 16 + 5
    q, scale = quantize_fp8(torch.tensor([[448.0, -1.0, 0.0, 2.0]]), 1)
    assert q.dtype == torch.float8_e4m3fn and scale.tolist() == [[1.0]]


def test_sglang_backend_pieces(tmp_path, model):
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(RuntimeError) as err:
            import_sglang()
        assert str(err.value) == SGLANG_MISSING and "eaglescale[sglang]" in SGLANG_MISSING
    aux_kw = engine_kwargs("/m", "aux", capture_draft_path="/draft", context_length=4096)
    assert (
        aux_kw["speculative_algorithm"] == "EAGLE3"
        and aux_kw["speculative_draft_model_path"] == "/draft"
    )
    assert {
        k: aux_kw[k]
        for k in ("enable_return_hidden_states", "disable_radix_cache", "skip_tokenizer_init")
    } == dict.fromkeys(
        ("enable_return_hidden_states", "disable_radix_cache", "skip_tokenizer_init"), True
    )
    assert {
        aux_kw[k]
        for k in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
    } == {1, 2}
    last_kw = engine_kwargs("/m", "last")
    assert (
        not any(k.startswith("speculative") for k in last_kw)
        and last_kw["chunked_prefill_size"] == -1
    )
    with pytest.raises(ValueError, match="capture_draft_path"):
        engine_kwargs("/m", "aux")

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]},
            }
        )
    )
    with pytest.raises(ValueError) as err:
        check_capture_draft(draft, "llama", IDS)
    assert "[1, 3, 5]" in str(err.value) and "[2, 4, 5]" in str(err.value)

    # Stand-in engines answering in SGLang's recorded shape: meta_info.hidden_states is the
    # prefill's [T, W] rows (nested lists) followed by one [W] row per decoded token.
    seqs = _seqs(3, seed=7)
    truth = LocalCapture(model, IDS).capture(seqs)

    class Recorded:
        def __init__(self, width: str) -> None:
            self.width, self.requests = width, []

        def generate(self, input_ids, sampling_params, return_hidden_states):
            self.requests.append((input_ids, sampling_params, return_hidden_states))
            rows = [getattr(t, self.width) for t in truth]
            return [
                {
                    "text": "",
                    "output_ids": [9],
                    "meta_info": {"hidden_states": [r.tolist(), r[-1].tolist()]},
                }
                for r in rows
            ]

    aux_engine, last_engine = Recorded("aux"), Recorded("last")
    got = SGLangCapture(H, IDS, aux_engine, last_engine).capture(seqs)
    assert aux_engine.requests[0] == tuple(generate_request(seqs).values())
    for t, g in zip(truth, got, strict=True):
        torch.testing.assert_close(g.aux, t.aux)
        torch.testing.assert_close(g.last, t.last)
    with pytest.raises(ValueError, match="cover fewer than the 99 input tokens"):
        parse_hidden_states({"meta_info": {"hidden_states": [[[0.0] * H]]}}, 99)


def _training_seqs(states: list[CapturedStates]) -> list[TrainingSequence]:
    return [
        TrainingSequence(
            f"r{i:03d}", f"p{i}", "general_chat", "eval" if i % 2 else "train",
            list(range(st.aux.shape[0])), [0] + [1] * (st.aux.shape[0] - 1), False,
        )
        for i, st in enumerate(states)
    ]  # fmt: skip


@pytest.mark.parametrize("storage_dtype", ["bf16", "fp8_e4m3"])
def test_parts_split_by_bytes_whatever_the_grouping_and_equal_one_object(storage_dtype):
    states = _random_states(8)  # 3, 10, ..., 52 tokens
    seqs = _training_seqs(states)
    whole = ShardWriter(H, IDS, storage_dtype)
    whole.add_many(seqs, states)
    reference = decode_extract_shard(whole.to_bytes())
    per_token = bytes_per_token(H, storage_dtype)
    part_bytes = 40 * per_token  # the 45- and 52-token sequences each exceed a part
    layouts = []
    for grouping in ([8], [1] * 8, [3, 5], [5, 2, 1]):
        parts: list[bytearray] = []
        writer = ShardWriter(H, IDS, storage_dtype, part_bytes=part_bytes, on_part=parts.append)
        start = 0
        for size in grouping:
            writer.add_many(seqs[start : start + size], states[start : start + size])
            start += size
        writer.flush()
        layouts.append([shard_metadata(p)["sequence_ids"] for p in parts])
        assert writer.parts_written == len(parts)
        for name, stats in whole.error_report().items():  # summed in another order
            assert writer.error_report()[name] == pytest.approx(stats, rel=1e-9)
        back = [s for p in parts for s in decode_extract_shard(p)]
        assert [s.sequence_id for s in back] == [s.sequence_id for s in reference]
        for got, want in zip(back, reference, strict=True):
            for name in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name
        for p in parts:
            assert verify_shard(p) == shard_metadata(p)["sequence_ids"]
            from safetensors.torch import load

            assert set(load(bytes(p))) >= {"input_ids", "aux_hidden", "seq_offsets"}
    # Greedy on lengths only: 3+10+17 tokens fit 40, then 24, 31, 38, then one part each.
    assert layouts[0] == [
        ["r000", "r001", "r002"], ["r003"], ["r004"], ["r005"], ["r006"], ["r007"],
    ]  # fmt: skip
    assert all(layout == layouts[0] for layout in layouts)
    with pytest.raises(ValueError, match="on_part callback"):
        ShardWriter(H, IDS, storage_dtype, part_bytes=100)
