"""The EAGLE-3 draft model, named and wired exactly as SGLang's LlamaForCausalLMEagle3 serves it.

One decoder layer (`midlayer`) whose attention reads the token embedding concatenated with a
hidden state (2H wide):

    h      = fc(aux)                      only when the hidden input is 3H wide (first step)
    x      = cat(input_layernorm(embed(token)), hidden_norm(h))
    r      = h + o_proj(attention(x))    (post_attention_layernorm's fused residual add)
    r      = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(r))            over the draft vocabulary
    next   = r                           the PRE-norm state is what the next draft step reads

Position t pairs the token at t + 1 with the target's hidden state at t (rope position t)
and predicts the token at t + 2.

Decode-time use (issue 4's local speculative engine), one call per draft step:

    cache = draft.new_cache()
    out = draft.step(input_ids, hidden, positions, cache)   # logits [B, S, draft_vocab] (fp32),
                                                           # out.hidden [B, S, H]
    draft_token = out.logits[:, -1].argmax(-1); target_token = draft_token + draft.d2t[draft_token]

The first call after a target forward passes the target's concatenated aux states (3H, the
extend over the accepted tokens); later calls pass `out.hidden` (H) of the previous step at the
next position. New entries attend to every cached entry and causally among themselves;
`cache.truncate(n)` drops rejected entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tasks.draft.architecture import DraftConfig

# attend(q [B, heads, S, D], k, v [B, kv_heads, S, D], both rotated) -> [B, heads, S, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

EMBED_KEY = "embed_tokens.weight"


def llama_config(cfg: DraftConfig) -> LlamaConfig:
    """A transformers LlamaConfig for the pieces reused from transformers (RoPE, MLP)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        scaling = dict(cfg.rope_scaling)
        rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
        rope.update(scaling, rope_type=rope_type)
    return LlamaConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size,
        hidden_act=cfg.hidden_act,
        mlp_bias=False,
        rope_parameters=rope,
    )


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, kv_heads, S, D] -> [B, kv_heads * groups, S, D]; head h reads kv head h // groups."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class DraftAttention(nn.Module):
    """q/k/v read the 2H-wide [embedding, hidden] input; o_proj writes H."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
        )
        width = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [B, heads, S, D] and k, v [B, kv_heads, S, D]."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        b, _, s, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class DraftLayer(nn.Module):
    """SGLang's EAGLE-3 LlamaDecoderLayer (midlayer); returns the residual stream.

    Split at the attention (`qkv`, then `finish`) so torch.compile can fuse each side
    while the attention, which keeps state across unroll steps, runs as it is.
    """

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = LlamaMLP(llama_config(cfg))
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def qkv(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        return self.self_attn.project(x, cos, sin)

    def finish(self, attended: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        residual = hidden + self.self_attn.output(attended)
        return residual + self.mlp(self.post_attention_layernorm(residual))

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        # Contiguous: step 0's flash output and later steps' merged output differ in strides,
        # and the compiled `finish` would recompile on every (layout, shape) it meets.
        return self.finish(attend(*self.qkv(embeds, hidden, cos, sin)).contiguous(), hidden)

    def compile_parts(self) -> None:
        """torch.compile both sides in place (instance attributes: parameter names stay).
        Dynamic shapes: batches are padded to their longest sequence, so every batch has its own
        (B, T); specializing on the first ran into dynamo's recompile limit on the H200 (eight
        recompiles, then eager) and slowed training several times."""
        self.qkv = torch.compile(self.qkv, dynamic=True)
        self.finish = torch.compile(self.finish, dynamic=True)


@dataclass
class DraftStepOutput:
    logits: torch.Tensor  # float32 [B, S, draft_vocab]
    hidden: torch.Tensor  # [B, S, H], pre-norm: the next step's hidden input


class DraftKVCache:
    """Rotated keys and values of every position the draft has seen, per batch row."""

    def __init__(self) -> None:
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.key is None else self.key.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.key = k if self.key is None else torch.cat([self.key, k], dim=2)
        self.value = v if self.value is None else torch.cat([self.value, v], dim=2)
        return self.key, self.value

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} entries to {length}")
        if self.key is not None:
            self.key, self.value = self.key[:, :, :length], self.value[:, :, :length]


class Eagle3Draft(nn.Module):
    def __init__(self, config: DraftConfig, embed_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        self.midlayer = DraftLayer(config)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(llama_config(config))
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.reset_parameters()
        if embed_weight is not None:
            self.set_embedding(embed_weight)

    def reset_parameters(self) -> None:
        """HF's Llama init: N(0, initializer_range) linears, unit norms (seed torch first)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.config.initializer_range)
            elif isinstance(module, LlamaRMSNorm):
                nn.init.ones_(module.weight)

    def set_embedding(self, weight: torch.Tensor) -> None:
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(f"embedding must be {list(expected)}, got {list(weight.shape)}")
        self.embed_tokens.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab map of d2t {list(d2t.shape)} / t2d {list(t2d.shape)} does not fit the "
                f"draft's {list(self.d2t.shape)} / {list(self.t2d.shape)}"
            )
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    # -- export names ----------------------------------------------------------------------

    def exportable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor SGLang loads (all but the shared embedding), detached and contiguous."""
        return {
            k: v.detach().contiguous() for k, v in self.state_dict().items() if k != EMBED_KEY
        }

    def load_exportable_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        expected = {k: tuple(v.shape) for k, v in self.exportable_state_dict().items()}
        problems = [f"missing {k}" for k in sorted(set(expected) - set(sd))]
        problems += [f"unexpected {k}" for k in sorted(set(sd) - set(expected))]
        problems += [
            f"{k}: shape {list(sd[k].shape)}, expected {list(shape)}"
            for k, shape in expected.items()
            if k in sd and tuple(sd[k].shape) != shape
        ]
        if problems:
            raise ValueError("draft state dict does not fit the model: " + "; ".join(problems))
        self.load_state_dict({**sd, EMBED_KEY: self.embed_tokens.weight}, strict=True)

    # -- forward pieces, shared by training (ttt.py) and decoding -----------------------------

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """fc applied only to 3H-wide input, as SGLang does (the seed run's garbage draft)."""
        return self.fc(hidden) if hidden.shape[-1] != self.config.hidden_size else hidden

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(like, positions)

    def layer(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rope(positions, hidden)
        return self.midlayer(embeds, hidden, cos, sin, attend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    # -- decoding -------------------------------------------------------------------------------

    @staticmethod
    def new_cache() -> DraftKVCache:
        return DraftKVCache()

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftKVCache,
    ) -> DraftStepOutput:
        """One draft forward over S new positions (see the module docstring)."""
        groups = self.config.num_attention_heads // self.config.num_key_value_heads

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            past = cache.length
            keys, values = cache.append(k, v)
            s, total = q.shape[2], keys.shape[2]
            visible = torch.ones(s, total, dtype=torch.bool, device=q.device).tril(past)
            return F.scaled_dot_product_attention(
                q, repeat_kv(keys, groups), repeat_kv(values, groups), attn_mask=visible
            )

        out = self.layer(input_ids, self.project(hidden), positions, attend)
        return DraftStepOutput(self.logits(out).float(), out)

    forward = step
