"""Triton kernels of a decode layer on CUDA: a Llama layer in nine launches.

A small target's decode step on a GPU is bound by launching kernels, not by reading its
weights: the reference layer (:meth:`draftlab.models.target.Target._layer`) runs about fifty
ops, SDPA's math path over a boolean mask among them. Here a layer is

    add_rms_norm, QKV GEMM, rope_kv_write, attention, O GEMM, add_rms_norm, gate|up GEMM, silu_mul, down GEMM

(the GEMMs are torch's). Each kernel is named for what it fuses:

- :func:`add_rms_norm`: the residual add of the previous sublayer's output and the next RMSNorm.
- :func:`rope_kv_write`: RoPE on q and k (rotate-half convention, cos/sin computed once per
  forward) and the write of k and v into each row's cache slots.
- :func:`attention`: each query row of each sequence attends over its own cache slots
  ``0..slots[b, -1]`` under the step's boolean mask (past, causal or a draft tree), grouped-query
  heads sharing one K/V load; online softmax in float32 (FlashAttention's recurrence); a long
  span is split over programs and merged by one more kernel (flash-decoding).
- :func:`silu_mul`: SiLU of the gate times the up projection.

Every kernel reads its bounds from device tensors, so a forward is captured once per shape and
replayed (:mod:`draftlab.inference.graphs`). Numerics follow HF's Llama in the model's dtype: sums
and norms in float32, each op's result rounded to the dtype where HF rounds it. On CPU the kernels
run only in Triton's interpreter (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# ----------------------------------------------------------------------------- add + RMSNorm
@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, H, eps, HAS_D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=keep, other=0.0)
    if HAS_D:
        x = (x.to(tl.float32) + tl.load(d_ptr + row * H + cols, mask=keep, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * H + cols, x, mask=keep)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=keep, other=0.0)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * H + cols, y.to(x.dtype), mask=keep)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``(s, rms_norm(s) * weight)`` with ``s = x + delta`` (``s = x`` without ``delta``), rows of
    the last dimension; ``s`` is a new tensor (``x`` may be a hidden state a caller keeps)."""
    H = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    s = torch.empty_like(x) if delta is not None else x
    rows = x.numel() // H
    if rows:
        _add_rms_norm_kernel[(rows,)](x, delta.contiguous() if delta is not None else x, weight, s, out, H, eps,
                                      HAS_D=delta is not None, BLOCK=triton.next_power_of_2(H))
    return s, out


# ----------------------------------------------------------------------------- RoPE + KV write
@triton.jit
def _rope_kv_write_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_ptr, v_ptr,
                          T, NH, NKV, stride_kb, stride_kh, stride_ks,
                          D: tl.constexpr, HALF: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)  # b * T + t
    h = tl.program_id(1)  # 0..NH-1: a query head; NH..NH+NKV-1: a key/value head
    b = bt // T
    half = tl.arange(0, HALF)
    row = qkv_ptr + bt * (NH + 2 * NKV) * D
    c = tl.load(cos_ptr + bt * D + half).to(tl.float32)  # cos/sin repeat their halves (rotate-half RoPE)
    s = tl.load(sin_ptr + bt * D + half).to(tl.float32)
    x1 = tl.load(row + h * D + half)
    x2 = tl.load(row + h * D + HALF + half)
    dtype = x1.dtype
    # HF rounds x*cos and rotate_half(x)*sin to the dtype before their sum
    r1 = ((x1.to(tl.float32) * c).to(dtype).to(tl.float32) + (-x2.to(tl.float32) * s).to(dtype).to(tl.float32)).to(dtype)
    r2 = ((x2.to(tl.float32) * c).to(dtype).to(tl.float32) + (x1.to(tl.float32) * s).to(dtype).to(tl.float32)).to(dtype)
    if h < NH:
        dst = q_ptr + (bt * NH + h) * D
        tl.store(dst + half, r1)
        tl.store(dst + HALF + half, r2)
    else:
        kh = h - NH
        slot = tl.load(slots_ptr + bt)
        kdst = k_ptr + b * stride_kb + kh * stride_kh + slot * stride_ks
        tl.store(kdst + half, r1)
        tl.store(kdst + HALF + half, r2)
        vsrc = row + (NH + NKV + kh) * D
        vdst = v_ptr + b * stride_kb + kh * stride_kh + slot * stride_ks
        tl.store(vdst + half, tl.load(vsrc + half))
        tl.store(vdst + HALF + half, tl.load(vsrc + HALF + half))


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """RoPE on the q and k of ``qkv`` [B, T, (NH + 2 NKV) * D] (cos, sin [B, T, D]); k and v go to
    ``k_cache``/``v_cache`` [B, NKV, S, D] at ``slots`` [B, T]; returns q [B, T, NH, D]."""
    B, T, _ = qkv.shape
    D = k_cache.shape[-1]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q = torch.empty(B, T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    if B * T:
        _rope_kv_write_kernel[(B * T, num_heads + num_kv_heads)](
            qkv.contiguous(), cos.contiguous(), sin.contiguous(), slots.contiguous(), q, k_cache, v_cache,
            T, num_heads, num_kv_heads, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), D=D, HALF=D // 2)
    return q


# ----------------------------------------------------------------------------- attention
@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, slots_ptr, o_ptr, part_ptr, lse_ptr,
                      T, NKV, span, chunk, stride_kb, stride_kh, stride_ks, stride_mb, stride_mt, scale,
                      G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPLIT: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // NKV).to(tl.int64)
    kh = pid % NKV
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # query row r: input r // G, head kh * G + r % G
    split = tl.program_id(2)
    t = r // G
    head = kh * G + r % G
    live = t < T
    d = tl.arange(0, D)
    q_rows = (b * T + t) * (NKV * G) + head  # the (row, input, head) index of each query row
    q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    # this row of the batch attends no further than its last input's slot; this program, to its chunk
    end = tl.minimum(tl.load(slots_ptr + b * T + T - 1) + 1, (split + 1) * chunk)
    kv = b * stride_kb + kh * stride_kh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(split * chunk, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < end
        k = tl.load(k_ptr + kv + n[:, None] * stride_ks + d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_ptr + kv + n[:, None] * stride_ks + d[None, :], mask=inside[:, None], other=0.0)
        allowed = tl.load(mask_ptr + b * stride_mb + t[:, None] * stride_mt + n[None, :],
                          mask=live[:, None] & inside[None, :] & (n[None, :] < span), other=0) != 0
        if IEEE:  # float32 models: no TF32 rounding in the scores
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay empty
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:  # this chunk's softmax-weighted values and log-sum-exp, merged by _combine_kernel
        rows = split * (tl.num_programs(0) // NKV) * T * NKV * G + q_rows
        tl.store(part_ptr + rows[:, None] * D + d[None, :], out, mask=live[:, None])
        tl.store(lse_ptr + rows, tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf")), mask=live)
    else:
        tl.store(o_ptr + q_rows[:, None] * D + d[None, :], out.to(q.dtype), mask=live[:, None])


@triton.jit
def _combine_kernel(part_ptr, lse_ptr, o_ptr, rows, SPLITS: tl.constexpr, D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # a (batch row, input, head)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    lse = tl.load(lse_ptr + s * rows + row)
    top = tl.max(lse, axis=0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - tl.where(top == float("-inf"), 0.0, top)))
    part = tl.load(part_ptr + (s[:, None] * rows + row) * D + d[None, :])
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + row * D + d, out.to(o_ptr.dtype.element_ty))


# slots one attention program reads at most: longer spans split over programs (flash-decoding),
# so that one long row does not serialise a step
SPLIT_SLOTS = 256
MAX_SPLITS = 16


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Attention of q [B, T, NH, D] over ``k_cache``/``v_cache`` [B, NKV, S, D]: input t of row b
    sees slot n iff ``n <= slots[b, T-1]`` and ``mask[b, t, n]`` (bool [B, T, span], span <= S);
    returns [B, T, NH, D]. A row that sees no slot gets zeros. Spans past SPLIT_SLOTS run as
    chunks in parallel whose partial results one more kernel merges."""
    B, T, NH, D = q.shape
    NKV = k_cache.shape[1]
    G = NH // NKV
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and mask.stride(-1) == 1
    out = torch.empty_like(q)
    if not B * T:
        return out
    M = T * G
    block_m, block_n = (16 if M <= 16 else 32 if M <= 32 else 64), 64
    span = mask.shape[-1]
    splits = min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(span, SPLIT_SLOTS)))
    chunk = triton.cdiv(triton.cdiv(span, splits), block_n) * block_n
    part = lse = out
    if splits > 1:
        part = torch.empty(splits, B * T * NH, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, B * T * NH, dtype=torch.float32, device=q.device)
    _attention_kernel[(B * NKV, triton.cdiv(M, block_m), splits)](
        q.contiguous(), k_cache, v_cache, mask.view(torch.uint8) if mask.dtype == torch.bool else mask,
        slots.contiguous(), out, part, lse, T, NKV, span, chunk, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        mask.stride(0), mask.stride(1), scale, G=G, D=D, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=splits > 1,
        IEEE=q.dtype == torch.float32)
    if splits > 1:
        _combine_kernel[(B * T * NH,)](part, lse, out, B * T * NH, SPLITS=splits, D=D)
    return out


# ----------------------------------------------------------------------------- SiLU * up
@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < N
    g = tl.load(gu_ptr + row * 2 * N + cols, mask=keep, other=0.0)
    u = tl.load(gu_ptr + row * 2 * N + N + cols, mask=keep, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * N + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=keep)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [..., 2N] holding gate then up (one fused GEMM's output)."""
    N = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], N)
    rows = gate_up.numel() // (2 * N)
    if rows:
        block = min(1024, triton.next_power_of_2(N))
        _silu_mul_kernel[(rows, triton.cdiv(N, block))](gate_up, out, N, BLOCK=block)
    return out


# True when this process runs the kernels in Triton's CPU interpreter (TRITON_INTERPRET=1 was set
# before triton was imported).
INTERPRETED = not isinstance(_silu_mul_kernel, triton.runtime.jit.JITFunction)
