"""Fixed-shape forwards for speculative decoding: static KV caches, no host syncs, CUDA graphs.

`StaticTarget` runs a Llama-style transformers causal LM layer by layer through its own modules
(projections, norms, MLP, rotary embedding) with a preallocated KV cache; how a family's
attention makes q, k and v (biases are the projections' own; a per-head norm is the family's) is
its family module's `StaticForward` (tasks/target/families/); `StaticDraft`
does the same for an Eagle3Draft's midlayer. Cache slot p holds the key/value of rope position
p, and a query at position q sees exactly the slots <= q. That makes rollback free: entries
past the accepted length are either masked (beyond the query) or rewritten by the next forward
before anything reads them, so "truncating" a cache is bookkeeping on the host.

Nothing here reads a tensor back to the host or changes shape with the data, so a step made of
these calls can be captured once as a CUDA graph (`GraphedStep`) and replayed; with graphs off
the same step runs eagerly (CPU, tests, and the no-graph measurement).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tasks.draft.model import Eagle3Draft
from tasks.extract.local_capture import decoder_stack
from tasks.target.families.base import StaticForward
from tasks.target.families.registry import HOW_TO_ADD, family_for

# SDPA's memory-efficient kernel wants the mask's last dimension aligned; caches are rounded up.
_SLOT_ALIGN = 16


def causal_bias(positions: torch.Tensor, slots: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [groups*S, slots]: 0 where slot <= the query's position, -inf elsewhere,
    repeated for the query heads folded into the sequence axis (grouped_attention).
    Additive, not boolean: CPU SDPA with a boolean mask is ~20x slower at these shapes."""
    visible = slots[None, :] <= positions[:, None]
    bias = torch.zeros(visible.shape, dtype=dtype, device=slots.device)
    return bias.masked_fill(~visible, float("-inf")).repeat(groups, 1)


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [1, heads, S, D] against a whole static cache [1, kv_heads, slots, D] -> [1, heads, S, D].

    The query heads of one kv head are folded into its sequence axis ([1, kv, groups*S, D]),
    so the cache is read as it is, never repeated per query head (head h reads kv head
    h // groups, as transformers' repeat_kv does)."""
    _, heads, s, d = q.shape
    kv = keys.shape[1]
    folded = q.reshape(1, kv, (heads // kv) * s, d)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=bias, scale=scale)
    return out.reshape(1, heads, s, d)


def _aligned(n: int) -> int:
    return -(-n // _SLOT_ALIGN) * _SLOT_ALIGN


def _static_forward(model: PreTrainedModel, attn: torch.nn.Module) -> StaticForward:
    """The target family's StaticForward, checked against the model's own attention modules."""
    model_type = model.config.model_type
    static = family_for(model_type, "the local engine's static forward").static
    if static is None:
        raise ValueError(
            f"{model_type}: the local engine's static forward does not run this family (its family "
            f"module has no StaticForward; {HOW_TO_ADD})"
        )
    missing = [name for name in static.modules if not hasattr(attn, name)]
    # A per-head q/k norm the family does not declare would be skipped: refused, not guessed.
    undeclared = [name for name in ("q_norm", "k_norm") if hasattr(attn, name) and name not in static.modules]
    if missing:
        raise ValueError(f"{model_type}: {type(attn).__name__} has no {missing}: not the attention its "
                         "family module's StaticForward describes")  # fmt: skip
    if undeclared:
        raise ValueError(f"{model_type}: {type(attn).__name__} has {undeclared}, which its family "
                         "module's StaticForward does not apply")  # fmt: skip
    if getattr(model.config, "sliding_window", None):
        raise ValueError(f"{model_type}: sliding-window attention is not implemented by the static forward")
    return static


class StaticTarget:
    """The target's forward over S new tokens at given positions, with a static KV cache."""

    def __init__(self, model: PreTrainedModel, aux_layer_ids: list[int], max_len: int) -> None:
        self.model = model
        self.base, self.layers = decoder_stack(model)
        bad = [i for i in aux_layer_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"aux layer ids {bad} outside the target's {len(self.layers)} layers")
        self.static = _static_forward(model, self.layers[0].self_attn)
        attn = self.layers[0].self_attn
        cfg = model.config
        self.aux_layer_ids = list(aux_layer_ids)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.scale = float(getattr(attn, "scaling", self.head_dim**-0.5))
        self.aux_width = len(self.aux_layer_ids) * int(cfg.hidden_size)
        self.head = model.get_output_embeddings()
        weight = self.head.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.max_len = _aligned(max_len)
        shape = (len(self.layers), 1, self.kv_heads, self.max_len, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.slots = torch.arange(self.max_len, device=self.device)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, last_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [S] at positions [S] (int64, on the device) -> (logits [S or 1, vocab], aux
        [S, k*H] or None when the target has no aux layers to report).

        aux = the outputs of the layers in `aux_layer_ids`, concatenated in id order (the
        convention of local_capture); logits in the model's dtype, as transformers computes them.
        """
        s = ids.shape[0]
        h = self.base.embed_tokens(ids[None, :])
        cos, sin = self.base.rotary_emb(h, positions[None, :])
        bias = causal_bias(positions, self.slots, self.heads // self.kv_heads, h.dtype)
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = self.static.project_qkv(attn, x, self.heads, self.kv_heads, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.keys[i].index_copy_(2, positions, k)
            self.values[i].index_copy_(2, positions, v)
            out = grouped_attention(q, self.keys[i], self.values[i], bias, self.scale)
            h = h + attn.o_proj(out.transpose(1, 2).reshape(1, s, self.heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if i in self.aux_layer_ids:
                aux.append(h)
        last = self.base.norm(h[:, -1:] if last_only else h)
        by_id = dict(zip(sorted(self.aux_layer_ids), aux, strict=True))
        states = torch.cat([by_id[i] for i in self.aux_layer_ids], dim=-1)[0] if aux else None
        return self.head(last)[0], states


class StaticDraft:
    """Eagle3Draft.step with a static KV cache (same modules, same math)."""

    def __init__(self, draft: Eagle3Draft, max_len: int) -> None:
        self.draft = draft
        cfg = draft.config
        weight = draft.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.max_len = _aligned(max_len)
        shape = (1, cfg.num_key_value_heads, self.max_len, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.slots = torch.arange(self.max_len, device=self.device)
        self.scale = cfg.head_dim**-0.5
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads

    def forward(
        self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [S] (target ids), hidden [S, 3H or H], positions [S] -> (logits [S, draft_vocab]
        fp32, next hidden [S, H]); see tasks.draft.model for the pairing of tokens and states."""

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.keys.index_copy_(2, positions, k)
            self.values.index_copy_(2, positions, v)
            bias = causal_bias(positions, self.slots, self.groups, q.dtype)
            return grouped_attention(q, self.keys, self.values, bias, self.scale)

        d = self.draft
        out = d.layer(ids[None, :], d.project(hidden[None].to(self.dtype)), positions[None, :], attend)
        return d.logits(out).float()[0], out[0]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.draft.d2t[draft_ids]

    def chain(
        self,
        ext_ids: torch.Tensor,
        ext_hidden: torch.Tensor,
        ext_positions: torch.Tensor,
        last: torch.Tensor,
        num_steps: int,
    ) -> torch.Tensor:
        """Extend over (token, target state) pairs, then roll out `num_steps` draft tokens.

        Rows after `last` (a [1] index tensor) are padding: their slots lie beyond every real
        query and are rewritten by the rollout. Returns the draft tokens [num_steps] as target
        ids; the rollout feeds each token back with the hidden state that produced it."""
        logits, hidden = self.forward(ext_ids, ext_hidden, ext_positions)
        token = self.to_target_ids(logits.index_select(0, last).argmax(-1))
        h = hidden.index_select(0, last)
        pos = ext_positions.index_select(0, last)
        tokens = [token]
        for _ in range(num_steps - 1):
            pos = pos + 1
            logits, h = self.forward(token, h, pos)
            token = self.to_target_ids(logits.argmax(-1))
            tokens.append(token)
        return torch.cat(tokens)


class GraphedStep:
    """`fn()` (reads and writes only preallocated tensors) run eagerly or as a CUDA graph.

    `reset()` puts the inputs in a safe state (positions inside the caches) before each
    warm-up run and after capture: a warm-up or capture run advances positions in place."""

    def __init__(self, fn: Callable[[], None], use_graph: bool, reset: Callable[[], None], warmup: int = 2) -> None:
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        if not use_graph:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                reset()
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        reset()
        self.graph = graph

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()
