"""P5's target: a random-weight Llama whose greedy continuations a draft can learn.

NOT a language model. Plain random init makes greedy replies chaotic, so a draft learns nothing.
Changes to that random model, nothing else (why each, and the values P5 used: BENCHMARKS.md, P5):
a successor map over `subset` token ids in one random cycle, put in an untied lm_head built from
the embedding, so a final state along embed[v] makes succ(v) the argmax; every o_proj and
down_proj times `alpha`, so context overrides the successor a tunable fraction of the time
(`successor_agreement`); the embedding and those projections times `embed_scale` (residual RMS
~1, the function unchanged); lm_head sharpened by a power of two (`sharpen`, greedy unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=2048),
}  # fmt: skip


@dataclass
class SuccessorTarget:
    model: LlamaForCausalLM
    succ: torch.Tensor  # int64 [vocab] on the host: successor id, -1 outside S
    subset: int
    margin: float
    alpha: float
    embed_scale: float
    _base: list[tuple[torch.Tensor, torch.Tensor]]  # (o_proj, down_proj) per layer, * embed_scale

    def set_alpha(self, alpha: float) -> None:
        """Set every o_proj and down_proj to alpha * embed_scale * its random init, in place."""
        with torch.no_grad():
            for layer, (o, down) in zip(self.model.model.layers, self._base, strict=True):
                layer.self_attn.o_proj.weight.copy_(o * alpha)
                layer.mlp.down_proj.weight.copy_(down * alpha)
        self.alpha = alpha

    @torch.no_grad()
    def sharpen(self, seqs: list[list[int]], skip: int, want_top1: float) -> dict[str, object]:
        """Multiply lm_head by the smallest power of two (up to 256) at which the mean top-1
        probability over the positions of `seqs` after `skip` reaches `want_top1`. A pure
        temperature: the greedy argmax, hence the agreement, is unchanged (non-S rows stay 0).

        Needed because the argmax can follow succ while the distribution is nearly flat: the
        successor's logit is margin * cos(final state, embed[v]), and with context mixed in that
        cosine is small, so the teacher the draft is trained on would carry almost no signal."""
        head = self.model.get_output_embeddings().weight
        ids = torch.tensor(seqs, device=head.device)
        logits = self.model(ids).logits[:, skip:].float()
        top1 = {}
        for scale in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            top1[scale] = float(torch.softmax(logits * scale, dim=-1).amax(-1).mean())
            if top1[scale] >= want_top1:
                break
        head.mul_(scale)
        self.margin *= scale
        return {"scale": scale, "mean_top1_by_scale": top1}

    def describe(self) -> dict[str, object]:
        return {"successor_subset": self.subset, "logit_margin": self.margin, "alpha": self.alpha,
                "embed_scale": self.embed_scale, "tie_word_embeddings": False,
                "init": "transformers normal std 0.02; embed_tokens * embed_scale; o_proj, down_proj * "
                        "alpha * embed_scale; lm_head = successor map over the embedding"}  # fmt: skip


def build_target(shape: str, device: str, dtype: torch.dtype, *, seed: int, subset: int, alpha: float,
                 margin: float = 16.0, embed_scale: float = 50.0) -> SuccessorTarget:  # fmt: skip
    config = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, max_position_embeddings=4096,
                         rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    vocab, hidden = config.vocab_size, config.hidden_size
    if not 2 <= subset <= vocab - 2:
        raise ValueError(f"subset must be in [2, {vocab - 2}], got {subset}")
    g = torch.Generator().manual_seed(seed + 1)
    cycle = 2 + torch.randperm(vocab - 2, generator=g)[:subset]
    succ = torch.full((vocab,), -1, dtype=torch.long)
    succ[cycle] = cycle.roll(-1)
    with torch.no_grad():
        # The residual stream at RMS ~1 (as in a trained model) instead of 0.02: the greedy
        # function is unchanged (every sublayer reads an RMS-normed input, and its output is
        # scaled alike), but the aux states the draft's fc reads are no longer drowned by its
        # own sublayers' outputs at the draft's init, and RMSNorm's eps stops mattering.
        model.get_input_embeddings().weight.mul_(embed_scale)
        embed = model.get_input_embeddings().weight.float()
        rows = embed[cycle.to(embed.device)]
        head = torch.zeros(vocab, hidden, device=embed.device)
        head[cycle.roll(-1).to(embed.device)] = (
            rows / rows.norm(dim=-1, keepdim=True) * (margin / math.sqrt(hidden))
        )
        model.get_output_embeddings().weight.copy_(head)
    model = model.to(dtype).eval()
    base = [(layer.self_attn.o_proj.weight.detach() * embed_scale, layer.mlp.down_proj.weight.detach() * embed_scale)
            for layer in model.model.layers]  # fmt: skip
    target = SuccessorTarget(model, succ, subset, margin, 1.0, embed_scale, base)
    target.set_alpha(alpha)
    return target


def successor_agreement(succ: torch.Tensor, replies: list[list[int]]) -> dict[str, float]:
    """Fraction of reply steps x_i -> x_{i+1} with x_{i+1} = succ(x_i); mean run length of
    such steps; mean distinct tokens per reply."""
    follows, steps, runs = 0, 0, []
    for reply in replies:
        run = 0
        for a, b in zip(reply, reply[1:], strict=False):
            steps += 1
            if int(succ[a]) == b:
                follows += 1
                run += 1
            else:
                runs.append(run)
                run = 0
        runs.append(run)
    return {"agreement": follows / steps if steps else 0.0, "mean_run": sum(runs) / len(runs) if runs else 0.0,
            "distinct_per_reply": sum(len(set(r)) for r in replies) / max(1, len(replies))}  # fmt: skip
