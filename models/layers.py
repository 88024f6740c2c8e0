"""Decoder-layer building blocks shared by every drafter (EAGLE-1, EAGLE-3, later Medusa and
diffusion drafters). Parameter names follow HF Llama/Qwen (``self_attn.q_proj``,
``mlp.gate_proj``, ``input_layernorm`` ...) so export mappings stay one-line renames.

The attention is written out (no HF layer) because drafters need masks HF does not build:
training-time-test diagonals, EAGLE-2 tree masks over a KV cache, bidirectional blocks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict


class LayerShape(BaseModel):
    """The decoder-layer facts a drafter copies from its target's HF config."""

    model_config = ConfigDict(extra="forbid")

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str = "silu"
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    max_position_embeddings: int = 4096
    rope: dict  # the target config's rope parameters (theta, scaling), passed to HF's rotary class

    @classmethod
    def from_hf(cls, cfg) -> "LayerShape":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {
            "rope_theta": getattr(cfg, "rope_theta", 10000.0),
            "rope_type": "default",
            **(getattr(cfg, "rope_scaling", None) or {}),
        }
        return cls(
            model_type=cfg.model_type,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            hidden_act=getattr(cfg, "hidden_act", "silu"),
            attention_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            qk_norm=cfg.model_type == "qwen3",
            max_position_embeddings=cfg.max_position_embeddings,
            rope=dict(rope),
        )

    def hf_config(self):
        """An HF config of the target's family with this shape (for RoPE and for exports)."""
        from transformers import AutoConfig

        return AutoConfig.for_model(
            self.model_type,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope),
            num_hidden_layers=1,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rotary(nn.Module):
    """cos/sin for positions, via HF's rotary class so every RoPE scaling variant matches the target."""

    def __init__(self, shape: LayerShape):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.inner = LlamaRotaryEmbedding(config=shape.hf_config())

    def forward(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: Long[B, T] -> cos, sin of shape [B, 1, T, D] (broadcast over heads)."""
        cos, sin = self.inner(like, positions)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, shape: LayerShape, in_dim: int | None = None):
        super().__init__()
        s = shape
        in_dim = in_dim or s.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.q_proj = nn.Linear(in_dim, s.num_attention_heads * s.head_dim, bias=s.attention_bias)
        self.k_proj = nn.Linear(in_dim, s.num_key_value_heads * s.head_dim, bias=s.attention_bias)
        self.v_proj = nn.Linear(in_dim, s.num_key_value_heads * s.head_dim, bias=s.attention_bias)
        self.o_proj = nn.Linear(s.num_attention_heads * s.head_dim, s.hidden_size, bias=False)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
            self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.qk_norm = s.qk_norm
        self.scale = s.head_dim**-0.5

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, in] -> q [B, h, T, D], k and v [B, h_kv, T, D] with RoPE applied."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, h, T, D] -> [B, T, hidden]."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))

    def attend(self, q, k, v, mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        """Plain attention. mask: bool [B or 1, T_q, T_k] (True = may attend)."""
        if mask is not None:
            mask = mask[:, None]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=self.scale, enable_gqa=True
        )


class MLP(nn.Module):
    def __init__(self, shape: LayerShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)
        if shape.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {shape.hidden_act!r} (only silu)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftKVCache:
    """A drafter's own growing K/V per layer ([B, h_kv, S, D]); ``crop`` rolls back drafts."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[i] is not None:
            k, v = torch.cat([self.k[i], k], 2), torch.cat([self.v[i], v], 2)
        self.k[i], self.v[i] = k, v
        return k, v

    def crop(self, n: int) -> None:
        self.k = [None if k is None else k[:, :, :n] for k in self.k]
        self.v = [None if v is None else v[:, :, :n] for v in self.v]


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer of the target's family, in three drafter flavours:

    * standard (``input_norm=True``): ``x = input_layernorm(h)``;
    * EAGLE-1's first layer (``input_norm=False``): the fc output enters attention un-normed;
    * EAGLE-3's first layer (``fuse_embedding=True``): attention reads
      ``[input_layernorm(embedding); hidden_norm(h)]`` (2H wide); the residual stream is ``h``,
      or ``hidden_norm(h)`` with ``norm_before_residual`` (speculators' flag of that name).

    ``attend(q, k, v)`` is supplied by the caller: causal, KV-cached, tree-masked or TTT.
    """

    def __init__(self, shape: LayerShape, input_norm: bool = True, fuse_embedding: bool = False, norm_before_residual: bool = False):
        super().__init__()
        H = shape.hidden_size
        self.fuse_embedding = fuse_embedding
        self.norm_before_residual = norm_before_residual
        if input_norm or fuse_embedding:
            self.input_layernorm = RMSNorm(H, shape.rms_norm_eps)
        if fuse_embedding:
            self.hidden_norm = RMSNorm(H, shape.rms_norm_eps)
        self.self_attn = Attention(shape, in_dim=2 * H if fuse_embedding else H)
        self.post_attention_layernorm = RMSNorm(H, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, h, cos, sin, attend, emb=None):
        if self.fuse_embedding:
            normed = self.hidden_norm(h)
            x = torch.cat([self.input_layernorm(emb), normed], dim=-1)
            if self.norm_before_residual:
                h = normed
        elif hasattr(self, "input_layernorm"):
            x = self.input_layernorm(h)
        else:
            x = h
        q, k, v = self.self_attn.qkv(x, cos, sin)
        h = h + self.self_attn.out(attend(q, k, v))
        return h + self.mlp(self.post_attention_layernorm(h))


def ttt_attention(q, ks, vs, scale: float) -> torch.Tensor:
    """Training-time-test attention for TTT step i = len(ks) - 1.

    The query at position t attends to the step-0 keys k0[0..t] (causal, the real context)
    plus only the diagonal keys k_j[t], j = 1..i (its own earlier draft steps at the same
    position) — exactly what it sees at inference when it is the (i+1)-th drafted token.
    q [B, h, T, D]; ks/vs lists of [B, h_kv, T, D].

    On CPU the causal part runs as fused flash attention that also returns its log-sum-exp,
    and the i diagonal keys are merged in with a small softmax: no T x T score matrix is
    materialised (faster and smaller than :func:`ttt_attention_dense`, the reference it is
    tested against). Elsewhere the dense form runs.
    """
    if q.device.type != "cpu" or _FLASH_CPU is None:
        return ttt_attention_dense(q, ks, vs, scale)
    B, h, T, D = q.shape
    hk = ks[0].shape[1]
    g = h // hk
    o0, lse0 = CausalAttentionLSE.apply(q, ks[0].repeat_interleave(g, 1), vs[0].repeat_interleave(g, 1), scale)
    qg = q.view(B, hk, g, T, D)
    K = torch.stack(ks[1:], -2)  # [B, hk, T, i, D]
    V = torch.stack(vs[1:], -2)
    s_diag = torch.einsum("bkgtd,bktid->bkgti", qg, K) * scale
    w = torch.cat([lse0.view(B, hk, g, T, 1), s_diag], -1).softmax(-1)  # lse0 = log-mass of the context
    o = o0.view(B, hk, g, T, D) * w[..., :1] + torch.einsum("bkgti,bktid->bkgtd", w[..., 1:], V)
    return o.view(B, h, T, D)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class CausalAttentionLSE(torch.autograd.Function):
    """(out, log-sum-exp) of causal attention with PyTorch's CPU flash kernel; q, k, v
    [B, h, T, D] with k/v already expanded to h heads."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        out, lse = _FLASH_CPU(q, k, v, 0.0, True, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out, lse

    @staticmethod
    def backward(ctx, g_out, g_lse):
        q, k, v, out, lse = ctx.saved_tensors
        g_out = torch.zeros_like(out) if g_out is None else g_out
        g_lse = torch.zeros_like(lse) if g_lse is None else g_lse
        # The flash backward computes dS = P * (dO V^T - rowsum(dO * O)). Since d lse / dS = P,
        # the lse gradient adds P * g_lse: an extra head-dim column with V = 0, dO = 1 and
        # O = -g_lse puts exactly that into the rowsum term and changes nothing else.
        zq, zk = q.new_zeros(*q.shape[:-1], 1), k.new_zeros(*k.shape[:-1], 1)
        gq, gk, gv = _FLASH_CPU_BWD(
            torch.cat([g_out.contiguous(), torch.ones_like(zq)], -1),
            torch.cat([q, zq], -1),
            torch.cat([k, zk], -1),
            torch.cat([v, zk], -1),
            torch.cat([out, -g_lse.unsqueeze(-1).to(out.dtype)], -1),
            lse,
            0.0,
            True,
            scale=ctx.scale,
        )
        return gq[..., :-1], gk[..., :-1], gv[..., :-1], None


def ttt_attention_dense(q, ks, vs, scale: float) -> torch.Tensor:
    """Reference form of :func:`ttt_attention` with an explicit score matrix."""
    B, h, T, D = q.shape
    hk = ks[0].shape[1]
    qg = q.view(B, hk, h // hk, T, D)
    k0, v0 = ks[0].unsqueeze(2), vs[0].unsqueeze(2)
    s0 = torch.matmul(qg, k0.transpose(-1, -2)) * scale  # [B, hk, g, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [(qg * k.unsqueeze(2)).sum(-1, keepdim=True) * scale for k in ks[1:]]
    p = torch.cat([s0, *diag], dim=-1).softmax(-1)
    o = torch.matmul(p[..., :T], v0)
    for j, v in enumerate(vs[1:]):
        o = o + p[..., T + j : T + j + 1] * v.unsqueeze(2)
    return o.view(B, h, T, D)
