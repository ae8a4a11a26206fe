"""Attention of the training-time-test unroll: causal over step 0, diagonal over later steps.

At unroll step k the query at index t sees step 0's keys at 0..t and the keys steps 1..k
produced at index t. Softmax over that union = merging a causal attention (output O_c,
log-sum-exp L_c) with k extra scores s_i:

    L = logaddexp(L_c, logsumexp_i s_i);   O = exp(L_c - L) O_c + sum_i exp(s_i - L) v_i

On CUDA with bf16/fp16 the causal part is PyTorch's flash kernel (CPU's flash kernel when a
test asks for it), and the backward calls the
flash backward with the MERGED output and log-sum-exp (as ring attention does): the kernel
recomputes P = exp(qk - L) and D = rowsum(dO * O) from them, which are exactly the causal
part's gradients in the merged softmax; the diagonal part's gradients are a few elementwise
products. Elsewhere (CPU tests, fp32) a plain masked softmax does the same with autograd.
"""

from __future__ import annotations

import math

import torch

from tasks.draft.model import repeat_kv


def _diag_scores(q: torch.Tensor, keys: torch.Tensor, groups: int, scale: float) -> torch.Tensor:
    """q [B, H, T, D], keys [S, B, Hkv, T, D] -> fp32 [S, B, H, T]: q_t . k_i,t * scale."""
    s, b, hkv, t, d = keys.shape
    qg = q.reshape(1, b, hkv, groups, t, d).float()
    return (qg * keys.unsqueeze(3).float()).sum(-1).view(s, b, hkv * groups, t) * scale


def merge_forward(q, kx, vx, out_c, lse_c, groups: int, scale: float):
    """Fold the diagonal keys into the causal output: (out in q's dtype, merged lse fp32)."""
    s_count, b, hkv, t, d = kx.shape
    s = _diag_scores(q, kx, groups, scale)
    lse = torch.logaddexp(lse_c, torch.logsumexp(s, dim=0))
    p = torch.exp(s - lse).view(s_count, b, hkv, groups, t, 1)
    extra = (p * vx.unsqueeze(3).float()).sum(0).reshape(b, hkv * groups, t, d)
    out = torch.exp(lse_c - lse).unsqueeze(-1) * out_c.float() + extra
    return out.to(q.dtype), lse


def merge_backward(q, kx, vx, dout, out, lse, groups: int, scale: float):
    """The diagonal keys' share of the gradients: (dq part, dkx, dvx)."""
    s_count, b, hkv, t, d = kx.shape
    p = torch.exp(_diag_scores(q, kx, groups, scale) - lse).view(s_count, b, hkv, groups, t, 1)
    big_d = (dout.float() * out.float()).sum(-1).view(1, b, hkv, groups, t, 1)
    dout_g = dout.reshape(1, b, hkv, groups, t, d).float()
    dp = (dout_g * vx.unsqueeze(3).float()).sum(-1, keepdim=True)
    ds = p * (dp - big_d) * scale
    dq = (ds * kx.unsqueeze(3).float()).sum(0).reshape(b, hkv * groups, t, d)
    dkx = (ds * q.reshape(1, b, hkv, groups, t, d).float()).sum(3)
    dvx = (p * dout_g).sum(3)
    return dq, dkx.to(kx.dtype), dvx.to(vx.dtype)


_COMPILED: dict[str, object] = {}


def _merge_fns(compiled: bool):
    """(merge_forward, merge_backward), compiled once per process when asked: inductor fuses
    the broadcasts and reductions so no [S, B, H, T, D] fp32 temporary is ever written."""
    if not compiled:
        return merge_forward, merge_backward
    if not _COMPILED:
        _COMPILED["fwd"] = torch.compile(merge_forward, dynamic=True)
        _COMPILED["bwd"] = torch.compile(merge_backward, dynamic=True)
    return _COMPILED["fwd"], _COMPILED["bwd"]


def _flash_forward(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Causal flash attention: (out, lse [B, H, >=T] fp32, what the backward needs)."""
    if q.is_cuda:
        out, lse, cq, ck, mq, mk, seed, offset, _ = (
            torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        )
        return out, lse, (cq, ck, mq, mk, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _flash_backward(dout, q, k, v, out, lse, state: tuple, scale: float):
    if q.is_cuda:
        cq, ck, mq, mk, seed, offset = state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, seed, offset, scale=scale
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, True, scale=scale
    )


class _FlashTTT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k0, v0, kx, vx, groups: int, scale: float, compiled: bool):
        t = q.shape[2]
        k0r, v0r = repeat_kv(k0, groups), repeat_kv(v0, groups)
        out_c, lse_c, state = _flash_forward(q, k0r, v0r, scale)
        lse_width = lse_c.shape[-1]
        lse_c = lse_c[..., :t]
        if kx.shape[0]:
            out, lse = _merge_fns(compiled)[0](q, kx, vx, out_c, lse_c, groups, scale)
        else:
            lse, out = lse_c, out_c
        ctx.save_for_backward(q, k0r, v0r, kx, vx, out, lse)
        ctx.flash = (state, lse_width)
        ctx.groups, ctx.scale, ctx.compiled = groups, scale, compiled
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0r, v0r, kx, vx, out, lse = ctx.saved_tensors
        state, lse_width = ctx.flash
        groups, scale = ctx.groups, ctx.scale
        b, h, t, d = q.shape
        dout = dout.contiguous()
        lse_full = torch.nn.functional.pad(lse, (0, lse_width - t)).contiguous()
        dq, dk0r, dv0r = _flash_backward(dout, q, k0r, v0r, out, lse_full, state, scale)
        hkv = h // groups
        dk0 = dk0r.view(b, hkv, groups, t, d).sum(2)
        dv0 = dv0r.view(b, hkv, groups, t, d).sum(2)
        dkx = dvx = None
        if kx.shape[0]:
            dq_x, dkx, dvx = _merge_fns(ctx.compiled)[1](q, kx, vx, dout, out, lse, groups, scale)
            dq = (dq.float() + dq_x).to(dq.dtype)
        return dq, dk0, dv0, dkx, dvx, None, None, None


def _math_ttt(q, k0, v0, kx, vx, groups: int, scale: float) -> torch.Tensor:
    t = q.shape[2]
    scores = (q @ repeat_kv(k0, groups).transpose(-1, -2)).float() * scale
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    if kx.shape[0]:
        extra = _diag_scores(q, kx, groups, scale).permute(1, 2, 3, 0)  # [B, H, T, S]
        scores = torch.cat([scores, extra], dim=-1)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = probs[..., :t] @ repeat_kv(v0, groups)
    for i in range(kx.shape[0]):
        out = out + probs[..., t + i, None] * repeat_kv(vx[i], groups)
    return out


def flash_usable(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


class TTTAttention:
    """The `attend` callable for one unroll: call it once per step, in order."""

    def __init__(self, groups: int, use_flash: bool | None = None, compiled: bool = False) -> None:
        self.groups = groups
        self.use_flash = use_flash
        self.compiled = compiled
        self.k0: torch.Tensor | None = None
        self.v0: torch.Tensor | None = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k0 is None:
            self.k0, self.v0 = k, v
        else:
            self.keys.append(k)
            self.values.append(v)
        empty = k.new_zeros((0, *k.shape))
        kx = torch.stack(self.keys) if self.keys else empty
        vx = torch.stack(self.values) if self.values else empty
        scale = 1.0 / math.sqrt(q.shape[-1])
        flash = flash_usable(q) if self.use_flash is None else self.use_flash
        if flash:
            return _FlashTTT.apply(q, self.k0, self.v0, kx, vx, self.groups, scale, self.compiled)
        return _math_ttt(q, self.k0, self.v0, kx, vx, self.groups, scale)
