"""The EAGLE-3 draft model: SGLang's names and shapes, the TTT unroll against decode-time
steps, the attention and loss kernels against plain autograd, target heads, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tasks.draft import checkpoint as ckpt
from tasks.draft.architecture import DraftConfig
from tasks.draft.model import Eagle3Draft
from tasks.draft.target_heads import TargetHeadsError, load_target_heads
from tasks.draft.ttt import SoftCrossEntropy, compute_teacher, unroll
from tasks.draft.ttt_attention import TTTAttention
from tasks.runfolder import RunFolder
from tasks.target.model_dir import read_model_config

H, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, DRAFT_VOCAB = 32, 4, 2, 8, 64, 100, 40


def small_config(**overrides) -> DraftConfig:
    values = dict(
        hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=256, vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=[1, 3, 4], target_hidden_size=H,
        target_num_layers=8,
    )
    values.update(overrides)
    return DraftConfig(**values)


def small_draft(seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    return Eagle3Draft(small_config(), torch.randn(VOCAB, H)).eval()


def test_parameter_names_shapes_and_dtypes_are_sglangs():
    draft = small_draft()
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in draft.exportable_state_dict().items()}
    f32 = torch.float32
    assert shapes == {
        "fc.weight": ((H, 3 * H), f32),
        "midlayer.self_attn.q_proj.weight": ((HEADS * HEAD_DIM, 2 * H), f32),
        "midlayer.self_attn.k_proj.weight": ((KV_HEADS * HEAD_DIM, 2 * H), f32),
        "midlayer.self_attn.v_proj.weight": ((KV_HEADS * HEAD_DIM, 2 * H), f32),
        "midlayer.self_attn.o_proj.weight": ((H, HEADS * HEAD_DIM), f32),
        "midlayer.mlp.gate_proj.weight": ((INTER, H), f32),
        "midlayer.mlp.up_proj.weight": ((INTER, H), f32),
        "midlayer.mlp.down_proj.weight": ((H, INTER), f32),
        "midlayer.hidden_norm.weight": ((H,), f32),
        "midlayer.input_layernorm.weight": ((H,), f32),
        "midlayer.post_attention_layernorm.weight": ((H,), f32),
        "norm.weight": ((H,), f32),
        "lm_head.weight": ((DRAFT_VOCAB, H), f32),
        "d2t": ((DRAFT_VOCAB,), torch.int64),
        "t2d": ((VOCAB,), torch.bool),
    }
    assert tuple(draft.embed_tokens.weight.shape) == (VOCAB, H)
    assert not draft.embed_tokens.weight.requires_grad
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert trainable == {k for k in shapes if k not in ("d2t", "t2d")}


def test_state_dict_round_trip_and_refusals_name_the_key():
    source, target = small_draft(0), small_draft(1)
    target.load_exportable_state_dict(source.exportable_state_dict())
    for key, value in source.exportable_state_dict().items():
        assert torch.equal(target.exportable_state_dict()[key], value), key
    sd = source.exportable_state_dict()
    with pytest.raises(ValueError, match=r"fc.weight: shape \[32, 64\], expected \[32, 96\]"):
        target.load_exportable_state_dict({**sd, "fc.weight": torch.zeros(H, 2 * H)})
    missing = {k: v for k, v in sd.items() if k != "norm.weight"}
    with pytest.raises(ValueError, match="missing norm.weight"):
        target.load_exportable_state_dict(missing)
    with pytest.raises(ValueError, match="unexpected embed_tokens.weight"):
        target.load_exportable_state_dict({**sd, "embed_tokens.weight": torch.zeros(VOCAB, H)})


def test_config_from_target_uses_sglang_aux_layers(tiny_target_dir: Path):
    cfg = DraftConfig.from_target(read_model_config(tiny_target_dir), draft_vocab_size=32000)
    assert cfg.aux_layer_ids == [1, 3, 4]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        64, 4, 2, 16,
    )
    assert cfg.draft_vocab_size == cfg.vocab_size == 2048  # capped at the target vocabulary
    assert DraftConfig.from_target(
        {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 61, "vocab_size": 100}, 32
    ).aux_layer_ids == [1, 29, 57]
    kimi_like = {"model_type": "kimi_k25", "text_config": {
        "hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840,
        "num_attention_heads": 64, "intermediate_size": 18432,
        "rope_scaling": {"type": "yarn", "factor": 64.0}, "rope_theta": 50000.0}}
    big = DraftConfig.from_target(kimi_like, 32000, intermediate_size=8192)
    assert (big.aux_layer_ids, big.intermediate_size, big.target_model_type) == (
        [1, 29, 57], 8192, "kimi_k25",
    )
    assert big.rope_scaling == {"type": "yarn", "factor": 64.0}
    assert DraftConfig.from_dict(json.loads(json.dumps(big.to_dict()))) == big
    with pytest.raises(ValueError, match=r"unknown keys \['colour'\]"):
        DraftConfig.from_dict({**big.to_dict(), "colour": 1})
    with pytest.raises(ValueError, match="num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        small_config(num_key_value_heads=3)


def test_fc_applies_only_to_three_hidden_widths():
    draft = small_draft()
    aux, hidden = torch.randn(2, 5, 3 * H), torch.randn(2, 5, H)
    assert torch.equal(draft.project(aux), draft.fc(aux))
    assert draft.project(hidden) is hidden


def test_ttt_unroll_equals_decode_time_steps():
    """TTT step k at index t == the k-th decode step after an extend over positions 0..t."""
    draft = small_draft()
    steps, length = 4, 14
    ids = torch.randint(0, VOCAB, (1, length))
    aux = torch.randn(1, length, 3 * H)
    with torch.no_grad():
        unrolled = list(unroll(draft, ids, aux, steps))
        checked = 0
        for t in range(length - steps - 1):
            cache = draft.new_cache()
            out = draft.step(ids[:, 1 : t + 2], aux[:, : t + 1], torch.arange(t + 1)[None], cache)
            for k in range(steps):
                if k:
                    out = draft.step(ids[:, t + 1 + k : t + 2 + k], out.hidden[:, -1:],
                                     torch.tensor([[t + k]]), cache)
                expected = draft.logits(unrolled[k][0, t]).float()
                torch.testing.assert_close(out.logits[0, -1], expected, atol=2e-5, rtol=1e-5)
                checked += 1
            assert cache.length == t + steps
            cache.truncate(t + 1)
            assert cache.length == t + 1
    assert checked == (length - steps - 1) * steps


def _run_attention(use_flash: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(3)
    b, t = 2, 11
    qs = [torch.randn(b, HEADS, t, HEAD_DIM, requires_grad=True) for _ in range(4)]
    ks = [torch.randn(b, KV_HEADS, t, HEAD_DIM, requires_grad=True) for _ in range(4)]
    vs = [torch.randn(b, KV_HEADS, t, HEAD_DIM, requires_grad=True) for _ in range(4)]
    attend = TTTAttention(HEADS // KV_HEADS, use_flash=use_flash)
    outs = [attend(q, k, v) for q, k, v in zip(qs, ks, vs, strict=True)]
    sum(((o * (i + 1)) ** 2).sum() for i, o in enumerate(outs)).backward()
    return outs, [x.grad for x in qs + ks + vs]


def test_flash_merge_attention_matches_masked_softmax_with_gradients():
    """The flash path (here: PyTorch's CPU flash kernel) merges causal + diagonal parts and
    its custom backward gives the same gradients as autograd through a masked softmax."""
    outs_math, grads_math = _run_attention(False)
    outs_flash, grads_flash = _run_attention(True)
    for a, b in zip(outs_math, outs_flash, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads_math, grads_flash, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_soft_cross_entropy_value_and_gradient():
    torch.manual_seed(0)
    logits = torch.randn(37, DRAFT_VOCAB, requires_grad=True)
    target = torch.softmax(torch.randn(37, DRAFT_VOCAB), -1)
    weight = torch.full((37,), 1 / 37)
    ours, per_row = SoftCrossEntropy.apply(logits, target.flip(0), torch.arange(36, -1, -1),
                                           weight, 8)
    (grad,) = torch.autograd.grad(ours * 3.0, logits)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = -(target * torch.log_softmax(ref_logits, -1)).sum(-1).mean()
    (ref_grad,) = torch.autograd.grad(ref * 3.0, ref_logits)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad, ref_grad)
    torch.testing.assert_close(per_row, -(target * torch.log_softmax(logits.detach(), -1)).sum(-1))


def test_teacher_chunks_and_vocabularies():
    torch.manual_seed(0)
    last, head = torch.randn(2, 9, H), torch.randn(VOCAB, H)
    draft_ids = torch.arange(0, VOCAB, 2)[:DRAFT_VOCAB]
    full = compute_teacher(last, head, draft_ids, chunk=4, full_vocab=True)
    whole = compute_teacher(last, head, draft_ids, chunk=1000, full_vocab=True)
    logits = last @ head.T
    assert torch.equal(full.argmax, logits.argmax(-1))
    torch.testing.assert_close(full.probs, torch.softmax(logits[..., draft_ids], -1))
    torch.testing.assert_close(full.probs, whole.probs)
    restricted = compute_teacher(last, head, draft_ids, chunk=4, full_vocab=False)
    assert torch.equal(restricted.argmax, draft_ids[logits[..., draft_ids].argmax(-1)])


def test_target_heads_plain_sharded_and_tied(tiny_target_dir: Path, tmp_path: Path):
    from safetensors.torch import load_file

    weights = load_file(str(tiny_target_dir / "model.safetensors"))
    embed, head = load_target_heads(str(tiny_target_dir))
    assert torch.equal(embed, weights["model.embed_tokens.weight"])
    assert torch.equal(head, weights["lm_head.weight"])

    config = json.loads((tiny_target_dir / "config.json").read_text())
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": weights["model.embed_tokens.weight"]},
              str(sharded / "a.safetensors"))
    save_file({"lm_head.weight": weights["lm_head.weight"]}, str(sharded / "b.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "a.safetensors", "lm_head.weight": "b.safetensors"}}))
    embed2, head2 = load_target_heads(str(sharded))
    assert torch.equal(embed2, embed) and torch.equal(head2, head)

    tied = tmp_path / "tied"
    tied.mkdir()
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    save_file({"model.embed_tokens.weight": weights["model.embed_tokens.weight"]},
              str(tied / "model.safetensors"))
    embed3, head3 = load_target_heads(str(tied))
    assert torch.equal(head3, embed3)
    (tied / "config.json").write_text(json.dumps(config))
    with pytest.raises(TargetHeadsError, match="no lm_head.weight and tie_word_embeddings is not set"):
        load_target_heads(str(tied))


def test_checkpoint_needs_meta_and_matching_hashes(tmp_path: Path):
    run = RunFolder(str(tmp_path / "run"))
    draft = small_draft()
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    key = ckpt.save_checkpoint(run, 7, draft, optimizer, scheduler, {"step": 7})
    folder = run.path(key)
    assert sorted(run.listdir(key)) == sorted([*ckpt.FILES, "meta.json"])
    assert ckpt.is_complete(folder)
    loaded = ckpt.load_checkpoint_model(folder, draft.embed_tokens.weight)
    for name, value in draft.exportable_state_dict().items():
        assert torch.equal(loaded.exportable_state_dict()[name], value), name

    run.write_bytes_atomic(f"{key}/model.safetensors", b"tampered")
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors: sha256 does not match"):
        ckpt.load_checkpoint_model(folder)
    run.remove(f"{key}/meta.json")
    assert not ckpt.is_complete(folder)
    with pytest.raises(ckpt.CheckpointError, match="no meta.json"):
        ckpt.load_checkpoint_model(folder)
    assert ckpt.remove_incomplete(run) == [key]
    assert run.listdir(ckpt.CKPT_ROOT) == []


def _ttt_model_and_batch(mask: torch.Tensor):
    from tasks.draft.ttt import Batch, TTTModel

    draft = small_draft()
    torch.manual_seed(5)
    head = torch.randn(VOCAB, H)
    draft_ids = torch.arange(0, VOCAB, 2)[:DRAFT_VOCAB]
    b, t = mask.shape
    batch = Batch(torch.randint(0, VOCAB, (b, t)), mask, torch.randn(b, t, 3 * H),
                  torch.randn(b, t, H), torch.tensor([t] * b))
    return TTTModel(draft, head, draft_ids), batch


def test_ttt_loss_is_the_decayed_soft_cross_entropy_at_shifted_positions():
    from tasks.draft.ttt import counted_rows

    torch.manual_seed(4)
    mask = torch.rand(2, 13) > 0.4
    model, batch = _ttt_model_and_batch(mask)
    steps, decay = 3, 0.8
    loss, stats = model(batch, counted_rows(mask, steps, "cpu"), steps, decay, logits_chunk=5)
    draft_ids = model.draft_ids
    expected = torch.zeros(())
    with torch.no_grad():
        hiddens = list(unroll(model.draft, batch.input_ids, batch.aux_hidden, steps))
    for k in range(steps):
        terms = []
        for b in range(2):
            for t in range(13 - 2 - k):
                if mask[b, t + 2 + k]:  # the predicted token t+2+k is a response token
                    p = torch.softmax(batch.last_hidden[b, t + 1 + k] @ model.target_lm_head[draft_ids].T, -1)
                    logp = torch.log_softmax(model.draft.logits(hiddens[k][b, t]), -1)
                    terms.append(-(p * logp).sum())
        assert int(stats.count[k]) == len(terms)
        expected = expected + decay**k * torch.stack(terms).mean()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)


def test_nothing_counted_still_gives_every_parameter_a_gradient():
    from tasks.draft.ttt import counted_rows

    mask = torch.zeros(1, 9, dtype=torch.bool)
    model, batch = _ttt_model_and_batch(mask)
    loss, stats = model(batch, counted_rows(mask, 2, "cpu"), 2, 0.8, logits_chunk=4)
    loss.backward()
    assert float(loss.detach()) == 0.0 and stats.count.tolist() == [0.0, 0.0]
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and not param.grad.any(), name
