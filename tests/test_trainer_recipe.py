"""The training recipe's settings (issue 27) each change what they claim: AdamW's betas reach
the optimizer; per-token loss normalisation weighs every token alike whatever its batch's fill,
and per-batch is today's objective; the lm_head starts as the target's rows for the draft
vocabulary and stays so when frozen; aux-state noise is seeded, on in training and off in
evaluation; a resume with another recipe is refused naming the settings; gradient norms and
clip rates are in the curves; the pooled accept length is SGLang's."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save_file

from tasks.config import TrainConfig
from tasks.draft import checkpoint as ckpt
from tasks.draft.acceptance import (
    chain_totals,
    pooled_accept_length,
    replay_cycles,
    response_segments,
)
from tasks.draft.architecture import DraftConfig
from tasks.draft.model import Eagle3Draft
from tasks.draft.recipe import recipe_differences, recipe_record, start_from_target, with_aux_noise
from tasks.draft.target_heads import TargetHeadsError, load_target_heads, load_target_norm
from tasks.draft.trainer import TrainCallbacks, TrainError, build_optimizer, train_draft
from tasks.draft.ttt import Batch, TTTModel, counted_rows, stored_token_matches
from tasks.draft.vocab import VocabMap, build_vocab_map
from tasks.gate.records import RequestRecord, pooled_accept_lengths
from tasks.gate.replay import SequenceReplay, accept_stats
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import TRAIN_RESULT

H, VOCAB, DRAFT_VOCAB = 16, 64, 24


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_draft(seed: int = 0) -> Eagle3Draft:
    cfg = DraftConfig(hidden_size=H, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=128, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB,
                      aux_layer_ids=[1, 3, 4], target_hidden_size=H, target_num_layers=8)  # fmt: skip
    torch.manual_seed(seed)
    return Eagle3Draft(cfg, torch.randn(VOCAB, H))


def vocab_map() -> VocabMap:
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    counts[torch.arange(3, VOCAB, 2)] = torch.arange(3, VOCAB, 2)  # odd ids, gaps between them
    return build_vocab_map(counts, DRAFT_VOCAB)


# -- AdamW's betas -----------------------------------------------------------------------------


def test_betas_reach_the_optimizer():
    params = [torch.nn.Parameter(torch.zeros(3))]
    default, _ = build_optimizer(params, TrainConfig(), 10, torch.device("cpu"))
    assert default.param_groups[0]["betas"] == (0.9, 0.999)  # torch's and SpecForge's: the default since run 10
    before, _ = build_optimizer(params, TrainConfig(adam_betas=[0.9, 0.95]), 10, torch.device("cpu"))
    assert before.param_groups[0]["betas"] == (0.9, 0.95)
    with pytest.raises(ValueError, match=r"adam_betas must both be in \[0, 1\), got \[0.9, 1.0\]"):
        TrainConfig(adam_betas=[0.9, 1.0])


# -- loss normalisation ------------------------------------------------------------------------


def _ttt(seed: int = 0) -> TTTModel:
    vocab = vocab_map()
    draft = tiny_draft(seed)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    torch.manual_seed(seed + 1)
    return TTTModel(draft, torch.randn(VOCAB, H), vocab.draft_ids)


def _rows(n_tokens: int, response: slice, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n_tokens, dtype=torch.bool)
    mask[response] = True
    return {"ids": torch.randint(0, VOCAB, (n_tokens,), generator=g), "mask": mask,
            "aux": torch.randn(n_tokens, 3 * H, generator=g), "last": torch.randn(n_tokens, H, generator=g)}  # fmt: skip


def _batch(*seqs: dict[str, torch.Tensor]) -> Batch:
    t = max(len(s["ids"]) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.int64)
    mask = torch.zeros(len(seqs), t, dtype=torch.bool)
    aux, last = torch.zeros(len(seqs), t, 3 * H), torch.zeros(len(seqs), t, H)
    for i, s in enumerate(seqs):
        n = len(s["ids"])
        ids[i, :n], mask[i, :n], aux[i, :n], last[i, :n] = s["ids"], s["mask"], s["aux"], s["last"]
    return Batch(ids, mask, aux, last, torch.tensor([len(s["ids"]) for s in seqs]))


def _loss_and_grads(model: TTTModel, batch: Batch, denominator: float | None) -> tuple[torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    loss, _ = model(batch, counted_rows(batch.loss_mask, 3, "cpu"), 3, 0.8, 7, loss_denominator=denominator)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_per_token_normalisation_weighs_every_token_alike_whatever_the_batch_fill():
    model = _ttt()
    sparse = _rows(14, slice(10, 14), seed=1)  # 4 response tokens: a batch with few
    dense = _rows(20, slice(3, 20), seed=2)  # 17 of them
    # token: the same fixed denominator for every batch, so a token's gradient is the same
    # alone (a sparse batch) or beside many others: the batch's gradient is the sum of its
    # sequences' gradients.
    alone, g_sparse = _loss_and_grads(model, _batch(sparse), 512.0)
    other, g_dense = _loss_and_grads(model, _batch(dense), 512.0)
    both, g_both = _loss_and_grads(model, _batch(dense, sparse), 512.0)
    torch.testing.assert_close(both, alone + other)
    for a, b, ab in zip(g_sparse, g_dense, g_both, strict=True):
        torch.testing.assert_close(ab, a + b, atol=1e-7, rtol=1e-5)
    # batch: each batch averages over its own tokens, so the sparse batch's 4 tokens weigh
    # 17/4 times a dense batch's each, and beside the dense sequence their weight drops.
    alone_b, g_sparse_b = _loss_and_grads(model, _batch(sparse), None)
    other_b, g_dense_b = _loss_and_grads(model, _batch(dense), None)
    both_b, g_both_b = _loss_and_grads(model, _batch(dense, sparse), None)
    assert not torch.allclose(both_b, alone_b + other_b)
    assert not all(torch.allclose(ab, a + b) for a, b, ab in zip(g_sparse_b, g_dense_b, g_both_b, strict=True))


def test_per_batch_normalisation_is_todays_mean_over_each_steps_tokens():
    """decay**k times step k's mean soft cross-entropy over this batch's counted positions,
    value and gradient, against plain autograd (the objective before the setting existed)."""
    model = _ttt()
    batch = _batch(_rows(14, slice(6, 14), seed=1), _rows(11, slice(2, 9), seed=2))
    loss, grads = _loss_and_grads(model, batch, None)
    default, _ = model(batch, counted_rows(batch.loss_mask, 3, "cpu"), 3, 0.8, 7)
    assert torch.equal(default.detach(), loss)  # batch is the default

    from tasks.draft.ttt import unroll

    model.zero_grad(set_to_none=True)
    head = model.target_lm_head[model.draft_ids]
    expected = torch.zeros(())
    for k, hidden in enumerate(unroll(model.draft, batch.input_ids, batch.aux_hidden, 3)):
        terms = []
        for b in range(2):
            for t in range(batch.input_ids.shape[1] - 2 - k):
                if batch.loss_mask[b, t + 2 + k]:
                    p = torch.softmax(batch.last_hidden[b, t + 1 + k] @ head.T, -1)
                    terms.append(-(p * torch.log_softmax(model.draft.logits(hidden[b, t]), -1)).sum())
        expected = expected + 0.8**k * torch.stack(terms).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-6)
    for ours, ref in zip(grads, [p.grad for p in model.parameters() if p.requires_grad], strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


# -- lm_head and final norm from the target ------------------------------------------------------


def test_lm_head_and_norm_start_as_the_targets_rows_for_the_draft_vocabulary(tiny_target_dir: Path, tmp_path: Path):
    vocab = vocab_map()
    draft = tiny_draft()
    draft.set_vocab(vocab.d2t, vocab.t2d)
    torch.manual_seed(3)
    target_head, target_norm = torch.randn(VOCAB, H), torch.rand(H) + 0.5
    start_from_target(draft, target_head, vocab.draft_ids, target_norm,
                      TrainConfig(init_lm_head_from_target=True, freeze_lm_head=True, init_norm_from_target=True))
    # Row i is the target's row for draft token i: target id i + d2t[i], the i-th token t2d marks.
    marked = draft.t2d.nonzero().flatten()
    for i in range(DRAFT_VOCAB):
        assert int(i + draft.d2t[i]) == int(marked[i])
        assert torch.equal(draft.lm_head.weight[i], target_head[marked[i]])
    assert torch.equal(draft.norm.weight.detach(), target_norm)
    assert not draft.lm_head.weight.requires_grad and draft.norm.weight.requires_grad

    untouched = tiny_draft()
    before = untouched.lm_head.weight.detach().clone()
    start_from_target(untouched, target_head, vocab.draft_ids, None, TrainConfig())
    assert torch.equal(untouched.lm_head.weight, before) and untouched.lm_head.weight.requires_grad
    with pytest.raises(ValueError, match="freeze_lm_head needs train.init_lm_head_from_target"):
        TrainConfig(freeze_lm_head=True)
    # A draft started from an exported one has that draft's head: it may stay fixed, and nothing
    # may overwrite it or its norm with the target's.
    assert TrainConfig(freeze_lm_head=True, init_from="/drafts/shipped").freeze_lm_head
    for overwrite in ("init_lm_head_from_target", "init_norm_from_target"):
        with pytest.raises(ValueError, match=f"train.init_from starts every weight from that draft: .*{overwrite}"):
            TrainConfig(init_from="/drafts/shipped", **{overwrite: True})
    with pytest.raises(ValueError, match="train.init_from with train.scaling_fractions"):
        TrainConfig(init_from="/drafts/shipped", scaling_fractions=[0.5])

    # The final norm is read alone from the target's safetensors, refused where it means another thing.
    copy = tmp_path / "target"
    shutil.copytree(tiny_target_dir, copy)
    weights = load_file(str(copy / "model.safetensors"))
    weights["model.norm.weight"] = torch.linspace(0.5, 1.5, weights["model.norm.weight"].numel())
    save_file(weights, str(copy / "model.safetensors"))
    assert torch.equal(load_target_norm(str(copy)), weights["model.norm.weight"])
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "gemma2"}))
    with pytest.raises(TargetHeadsError, match="gemma2 target's norm scales by 1 \\+ weight"):
        load_target_norm(str(copy))


# -- aux-state noise ---------------------------------------------------------------------------


def test_aux_noise_is_seeded_by_seed_step_and_rank():
    batch = _batch(_rows(9, slice(3, 9), seed=1))
    assert with_aux_noise(batch, 0.0, 0, 5) is batch
    one, again = with_aux_noise(batch, 0.1, 0, 5), with_aux_noise(batch, 0.1, 0, 5)
    assert torch.equal(one.aux_hidden, again.aux_hidden)
    noise = one.aux_hidden - batch.aux_hidden
    assert 0.07 < float(noise.std()) < 0.13
    for other in (with_aux_noise(batch, 0.1, 0, 6), with_aux_noise(batch, 0.1, 1, 5), with_aux_noise(batch, 0.1, 0, 5, rank=1)):
        assert not torch.equal(other.aux_hidden, one.aux_hidden)
    assert torch.equal(one.input_ids, batch.input_ids) and torch.equal(one.last_hidden, batch.last_hidden)


def test_a_checkpoint_from_before_the_record_had_todays_fixed_recipe():
    """Checkpoints written before the recipe was recorded trained with what the code fixed then
    (betas, per-batch loss, random head and norm, no noise): only a change of those is refused."""
    today = recipe_record(TrainConfig(learning_rate=3e-3, adam_betas=[0.9, 0.95]), 100)
    assert recipe_differences(None, today) == []
    # The betas' default moved after the record began: such a checkpoint resumes only with the old betas.
    assert recipe_differences(None, recipe_record(TrainConfig(), 100)) == [
        "train.adam_betas: checkpoint [0.9, 0.95], this run [0.9, 0.999]"]
    assert recipe_differences(None, recipe_record(TrainConfig(adam_betas=[0.9, 0.999], init_lm_head_from_target=True), 100)) == [
        "train.adam_betas: checkpoint [0.9, 0.95], this run [0.9, 0.999]",
        "train.init_lm_head_from_target: checkpoint False, this run True",
    ]
    assert recipe_differences(today, recipe_record(TrainConfig(learning_rate=3e-3, adam_betas=[0.9, 0.95]), 100)) == []
    assert recipe_differences(today, recipe_record(TrainConfig(learning_rate=1e-3, adam_betas=[0.9, 0.95]), 100)) == [
        "train.learning_rate: checkpoint 0.003, this run 0.001"]
    # A checkpoint recorded before train.init_from started from random weights: resuming it from
    # a shipped draft is refused, and so is the other way round.
    started = recipe_record(TrainConfig(learning_rate=3e-3, adam_betas=[0.9, 0.95]), 100, "ab" * 32)
    before_key = {k: v for k, v in today.items() if k != "init_from_sha256"}
    assert recipe_differences(before_key, today) == []
    assert recipe_differences(before_key, started) == [f"train.init_from (its weights' sha256): checkpoint None, this run {'ab' * 32!r}"]
    assert recipe_differences(started, today) == [f"train.init_from (its weights' sha256): checkpoint {'ab' * 32!r}, this run None"]


# -- the pooled accept length --------------------------------------------------------------------


def test_pooled_accept_length_is_sglangs_on_a_hand_made_case():
    """Two sequences, 3 drafts per cycle. A: one prompt token, 9 response tokens; cycles accept
    3, 0, 2 drafts (4 + 1 + 3 tokens). B: two prompt tokens, 3 response tokens; cycles accept
    0, 0. SGLang's scheduler adds (accepted + 1) tokens and one cycle per request per verify:
    10 / 5 = 2.0. A mean of per-sequence ratios (8/3, 2/2) reads 1.83, and of SGLang's
    per-request meta_info spec_accept_length (completion_tokens / spec_verify_ct: 9/3, 3/2) 2.25."""
    k, t = 3, 10
    matches = torch.zeros(k, 2, t, dtype=torch.bool)
    matches[:, 0, 0] = True  # A: the cycle after x_1 accepts 3
    matches[:2, 0, 5] = True  # the cycle after x_6 accepts 2 (the one after x_5, at index 4: none)
    matches[1:, 1, 1] = True  # B: a miss at step 0 stops the chain whatever follows
    mask = torch.zeros(2, t, dtype=torch.bool)
    mask[0, 1:10] = True
    mask[1, 2:5] = True

    accepted = {"A": [3, 0, 2], "B": [0, 0]}
    sglang_scheduler = sum(a + 1 for acc in accepted.values() for a in acc) / sum(len(a) for a in accepted.values())
    assert sglang_scheduler == 2.0

    # The walk over each sequence (the gate's replay and its statistics) ...
    emitted_a, accepted_a = replay_cycles(matches[:, 0], response_segments(mask[0]), k)
    emitted_b, accepted_b = replay_cycles(matches[:, 1], response_segments(mask[1]), k)
    assert (accepted_a, accepted_b) == (accepted["A"], accepted["B"])
    assert (emitted_a, emitted_b) == ([4, 1, 3], [1, 1])
    records = [SequenceReplay("A", "d", {k: emitted_a}, {k: accepted_a}), SequenceReplay("B", "d", {k: emitted_b}, {k: accepted_b})]
    assert accept_stats(records, k, n_bootstrap=10, seed=0, ci_level=0.9)["accept_length"] == sglang_scheduler
    # ... the trainer's held-out count over a padded batch ...
    assert chain_totals(matches.numpy(), mask.numpy(), [k]) == {k: (10, 5)}
    assert pooled_accept_length(*chain_totals(matches.numpy(), mask.numpy(), [k])[k]) == sglang_scheduler
    # ... and the gate's pooling of SGLang's own per-request counts all read SGLang's number.
    served = [RequestRecord("c", "e", 0, i, name, "d", completion_tokens=1 + sum(e), spec_verify_ct=len(e))
              for i, (name, e) in enumerate((("A", emitted_a), ("B", emitted_b)))]  # fmt: skip
    assert pooled_accept_lengths(served)[0] == sglang_scheduler
    mean_of_ratios, mean_of_sglang_per_request = (8 / 3 + 2 / 2) / 2, (9 / 3 + 3 / 2) / 2
    assert sglang_scheduler not in (pytest.approx(mean_of_ratios), pytest.approx(mean_of_sglang_per_request))


def test_stored_token_matches_put_each_steps_prediction_where_the_chain_reads_it():
    ids = torch.tensor([[5, 6, 7, 8, 9, 0]])
    mask = torch.tensor([[False, True, True, True, True, False]])
    rows = counted_rows(mask, 2, "cpu")  # step 0 predicts 2..4 at 0..2; step 1 predicts 3..4 at 0..1
    predicted = torch.tensor([7, 1, 9, 8, 9])  # step 0 at t=0,1,2; step 1 at t=0,1
    out = stored_token_matches(predicted, rows, ids, 2)
    assert out[0, 0].tolist() == [True, False, True, False, False, False]
    assert out[1, 0].tolist() == [True, True, False, False, False, False]


# -- the trainer with the recipe's settings ------------------------------------------------------

RECIPE = {"adam_betas": [0.9, 0.999], "loss_normalization": "token", "init_lm_head_from_target": True,
          "freeze_lm_head": True, "init_norm_from_target": True, "aux_state_noise": 0.5,
          "max_steps": 6, "eval_every": 3, "save_every": 3, "max_grad_norm": 0.05}  # fmt: skip


def _lm_head(run: RunFolder, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    weights = st_load(run.read_bytes(f"{key}/model.safetensors"))
    return weights["lm_head.weight"], weights["d2t"]


def test_the_recipe_in_the_trainer_and_its_resume(make_run):
    cfg, run = make_run("recipe", **RECIPE)
    result = train_draft(run, cfg.train, cfg.target.model_path)
    _, target_head = load_target_heads(cfg.target.model_path)

    # The optimizer the trainer built carries the betas (read back from its saved state).
    opt = torch.load(io.BytesIO(run.read_bytes(f"{result.last_checkpoint}/optimizer.pt")), weights_only=True)
    assert [g["betas"] for g in opt["optimizer"]["param_groups"]] == [(0.9, 0.999)]
    # A frozen head is the target's rows for the draft vocabulary after every step.
    head, d2t = _lm_head(run, result.last_checkpoint)
    assert torch.equal(head, target_head[torch.arange(d2t.numel()) + d2t].float())

    # Curves: each step's gradient norm before clipping and whether it clipped; each eval
    # window's mean, largest and clip rate; result.json keeps both and the recipe.
    assert [h["step"] for h in result.history] == list(range(1, 7))
    assert all(h["grad_norm"] > 0 and h["clipped"] == (h["grad_norm"] > 0.05) for h in result.history)
    assert any(h["clipped"] for h in result.history)
    window = result.evals[1]
    assert window["step"] == 3 and window["train_steps"] == 3
    norms = [h["grad_norm"] for h in result.history[:3]]
    assert window["train_grad_norm"] == pytest.approx(sum(norms) / 3) and window["train_grad_norm_max"] == max(norms)
    assert window["train_clip_rate"] == sum(n > 0.05 for n in norms) / 3
    steps = result.history[:3]
    assert window["train_data_wait_s"] == pytest.approx(sum(h["data_wait_s"] for h in steps) / 3)
    assert window["train_step_s"] == pytest.approx(sum(h["batch_tokens"] / h["tok_per_s"] for h in steps) / 3)
    assert window["train_step_s"] > 0 and window["train_data_wait_s"] >= 0
    assert "train_clip_rate" not in result.evals[0]  # the untrained baseline has no window
    saved = run.read_json(TRAIN_RESULT)
    assert saved["history"][0]["grad_norm"] == result.history[0]["grad_norm"] and "clipped" in saved["history"][0]
    assert saved["evals"][-1]["train_clip_rate"] == result.evals[-1]["train_clip_rate"]
    assert saved["recipe"]["loss_normalization"] == "token" and saved["recipe"]["total_steps"] == 6
    assert all(e["pooled_accept_len_1"] >= 1.0 for e in result.evals)
    assert [f"pooled_accept_len_{k}" in result.evals[-1] for k in (1, 2, 3, 4)] == [True, True, True, False]

    # A resume with other recipe settings is refused before anything loads, each one named.
    other = cfg.train.model_copy(update={"adam_betas": (0.9, 0.95), "loss_normalization": "batch",
                                         "aux_state_noise": 0.0, "max_steps": 9})  # fmt: skip
    with pytest.raises(TrainError, match="trained with another recipe") as refused:
        train_draft(run, other, cfg.target.model_path)
    message = str(refused.value)
    for named in ("train.adam_betas: checkpoint [0.9, 0.999], this run [0.9, 0.95]",
                  "train.loss_normalization: checkpoint 'token', this run 'batch'",
                  "train.aux_state_noise: checkpoint 0.5, this run 0.0",
                  "train.epochs / train.max_steps (total steps): checkpoint 6, this run 9"):
        assert named in message
    assert "freeze_lm_head" not in message and "learning_rate" not in message

    # Seeded noise: a run stopped at step 3 and resumed draws what the straight one drew.
    cfg2, run2 = make_run("recipe-resumed", **RECIPE)

    class Stop(Exception):
        pass

    def stop(key: str) -> None:
        if key == ckpt.checkpoint_key(3):
            raise Stop(key)

    with pytest.raises(Stop):
        train_draft(run2, cfg2.train, cfg2.target.model_path, callbacks=TrainCallbacks(on_checkpoint=stop))
    resumed = train_draft(run2, cfg2.train, cfg2.target.model_path)
    assert resumed.resumed_from == ckpt.checkpoint_key(3)
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in result.history]
    assert [h["grad_norm"] for h in resumed.history] == [h["grad_norm"] for h in result.history]

    # Without noise and with a trainable head: the untrained evaluation is the same (no noise in
    # evaluation), the first training step's loss is not (noise in training), the head moves.
    quiet = {**RECIPE, "aux_state_noise": 0.0, "freeze_lm_head": False}
    cfg3, run3 = make_run("recipe-quiet", **quiet)
    plain = train_draft(run3, cfg3.train, cfg3.target.model_path)
    assert plain.evals[0] == result.evals[0]
    assert plain.history[0]["loss"] != result.history[0]["loss"]
    head3, d2t3 = _lm_head(run3, plain.last_checkpoint)
    assert torch.equal(d2t3, d2t)
    assert not torch.equal(head3, target_head[torch.arange(d2t.numel()) + d2t].float())
