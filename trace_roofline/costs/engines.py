"""Cost rules of the serving engines' own kernels outside aten, grouped per engine at the end
(`ENGINE_RULES`): vLLM's `_C` / `_C_cache_ops` ops, SGLang's `sgl_kernel` (FlashInfer's) and
`sglang::` ops, aiter's (ROCm), triton_kernels' MoE routing as vLLM records it.

Argument orders from vllm csrc/torch_bindings.cpp and sgl-kernel csrc/common_extension.cc.
Minimum bytes as everywhere: what the kernel must read once and write once; FLOPs by the aten
ops' conventions (`pointwise.NORMS`, `pointwise.POINTWISE_FLOPS`).

Design notes: docs/design.md ("trace_roofline/costs/").
"""

from __future__ import annotations

from collections.abc import Sequence

from trace_roofline.costs.call import Arg, Call, Cost, Io, Kind, Malformed, Rule, integer, last_dim, tensor
from trace_roofline.costs.pointwise import NORMS, POINTWISE_FLOPS
from trace_roofline.model import formulas

_ROPE_FLOPS = 3.0  # per rotated element: x·cos - y·sin (two multiplies, one add)


def engine_rms_norm(c: Call) -> Cost:
    """rms_norm(out [.., H], input [.., H], weight [H], eps) (vLLM `_C::rms_norm`, SGLang
    `rmsnorm`): reads input and weight, writes out; `NORMS["rms_norm"]` FLOPs per element."""
    out, x, w = tensor(c.args, 0), tensor(c.args, 1), tensor(c.args, 2, 1)
    if out.numel != x.numel or w.dims[0] != last_dim(x):
        raise Malformed(f"rms_norm out {out.dims}, input {x.dims}, weight {w.dims}")
    return Io(NORMS["rms_norm"] * x.numel, [x, w], out.numel, out.b, Kind.NORM, x.dtype).cost()


def fused_add_rms_norm(c: Call) -> Cost:
    """fused_add_rms_norm(input [.., H], residual [.., H], weight [H], eps) (vLLM; SGLang's
    fused_add_rmsnorm), in place: residual += input, then input = RMSNorm(residual) · weight.
    Reads input, residual and weight, writes residual and input; the add's FLOP plus
    `NORMS["rms_norm"]` per element."""
    x, res, w = tensor(c.args, 0), tensor(c.args, 1), tensor(c.args, 2, 1)
    if x.dims != res.dims or w.dims[0] != last_dim(x):
        raise Malformed(f"fused_add_rms_norm input {x.dims}, residual {res.dims}, "
                        f"weight {w.dims}")
    flops = (POINTWISE_FLOPS["add"] + NORMS["rms_norm"]) * x.numel
    nbytes = (formulas.elementwise_bytes(x.numel, x.numel, x.b)
              + formulas.elementwise_bytes(res.numel, res.numel, res.b)
              + formulas.elementwise_bytes(w.numel, 0, w.b))
    return Cost(Kind.NORM, flops, float(nbytes), x.dtype,
                f"{x.dims} + residual {res.dims} -> both, weight {w.dims}")


def aiter_rms_norm(c: Call) -> Cost:
    """aiter's rms_norm(input [.., H], weight [H], eps, ...) (vLLM's ROCm path), out returned:
    reads input and weight, writes input's size; `NORMS["rms_norm"]` FLOPs per element."""
    x, w = tensor(c.args, 0), tensor(c.args, 1, 1)
    if w.dims[0] != last_dim(x):
        raise Malformed(f"rms_norm input {x.dims}, weight {w.dims}")
    return Io(NORMS["rms_norm"] * x.numel, [x, w], x.numel, x.b, Kind.NORM, x.dtype).cost()


def add_rms_norm_out(c: Call) -> Cost:
    """A fused residual add + RMSNorm with its outputs apart: aiter's add_rmsnorm /
    rmsnorm2d_fwd_with_add[_ck](out, input, residual_in, residual_out, weight, eps, ...)
    (SGLang, vLLM on ROCm): residual_out = input + residual_in, out = RMSNorm(residual_out) ·
    weight. A norm with the residual add's bytes: input, residual_in and weight read, out and
    residual_out written; the add's FLOP plus `NORMS["rms_norm"]` per element."""
    out, x, res_in, res_out = (tensor(c.args, i) for i in range(4))
    w = tensor(c.args, 4, 1)
    if not (out.dims == x.dims == res_in.dims == res_out.dims) or w.dims[0] != last_dim(x):
        raise Malformed(f"add_rmsnorm out {out.dims}, input {x.dims}, residual {res_in.dims} "
                        f"-> {res_out.dims}, weight {w.dims}")
    flops = (POINTWISE_FLOPS["add"] + NORMS["rms_norm"]) * x.numel
    nbytes = (formulas.elementwise_bytes(x.distinct + res_in.distinct, 0, x.b)
              + formulas.elementwise_bytes(w.numel, 0, w.b)
              + formulas.elementwise_bytes(0, out.numel + res_out.numel, out.b))
    return Cost(Kind.NORM, flops, float(nbytes), x.dtype,
                f"{x.dims} + residual {res_in.dims} -> out, residual; weight {w.dims}")


def store_cache(c: Call) -> Cost:
    """SGLang's store_cache(k [T, n_kv·d], v [T, n_kv·d], k_cache, v_cache, loc [T], ...) (its
    ROCm path, `sglang::store_cache`): `_cache_write` of k and v at loc."""
    k, v = tensor(c.args, 0, min_rank=1), tensor(c.args, 1, min_rank=1)
    return _cache_write([k, v], [tensor(c.args, 2), tensor(c.args, 3)], tensor(c.args, 4, 1))


def _rope(heads: Sequence[Arg], tokens: int, head: int, table: Arg, pos: Arg) -> Cost:
    """Rotate the first rot_dim = table.dims[1] dims of every head of the `heads` tensors
    ([tokens, .. heads·head ..]) in place, each token's cos|sin row gathered from `table`
    [max_position, rot_dim] at its position: rotated elements read and written, the rows read
    (at most the table's), the positions read; `_ROPE_FLOPS` per rotated element."""
    rot = table.dims[1]
    if tokens < 1 or head < 1 or rot > head:
        raise Malformed(f"{tokens} tokens, head_size {head}, rot_dim {rot}")
    nbytes, rotated = 0.0, 0
    for x in heads:
        if x.numel % (tokens * head):
            raise Malformed(f"{x.dims} is not {tokens} tokens of heads of {head}")
        n = x.numel // head * rot
        rotated += n
        nbytes += formulas.elementwise_bytes(n, n, x.b)
    nbytes += formulas.elementwise_bytes(min(tokens, table.dims[0]) * rot, 0, table.b)
    nbytes += formulas.elementwise_bytes(pos.distinct, 0, pos.b)
    shape = " ".join(str(x.dims) for x in heads) + f" rot {rot} of head {head}"
    return Cost(Kind.ELEMENTWISE, _ROPE_FLOPS * rotated, float(nbytes), heads[0].dtype, shape)


def rotary_embedding(c: Call) -> Cost:
    """vLLM's rotary_embedding(positions [T] or [B, S], query [.., n_q·d] or [.., n_q, d],
    key (likewise, or None), head_size, cos_sin_cache [max_position, rot_dim], is_neox):
    `_rope` over query and key, T = positions' elements, head_size from Concrete Inputs."""
    pos, q, table = tensor(c.args, 0), tensor(c.args, 1), tensor(c.args, 4, 2)
    if not c.args[3].concrete:
        return Cost(uncosted=f"{c.name}: head_size not recorded (Concrete Inputs)")
    head = integer(c.args[3].concrete, "rotary_embedding head_size")
    key = [c.args[2]] if c.args[2].is_tensor else []
    return _rope([q, *key], pos.numel, head, table, pos)


def apply_rope_cos_sin_cache(c: Call) -> Cost:
    """SGLang's (FlashInfer's) apply_rope_pos_ids_cos_sin_cache(q [T, n_q, d], k [T, n_kv, d],
    q_rope, k_rope, cos_sin_cache [max_position, rot_dim], pos_ids [T], interleave, ...):
    `_rope` over q and k (SGLang passes q and k as their own outputs). A fused KV-cache store
    (the later `v, k_buffer, v_buffer, kv_cache_loc` arguments, when tensors) adds
    `_cache_write` of the rotated k and v."""
    q, k = tensor(c.args, 0, 3), tensor(c.args, 1, 3)
    table, pos = tensor(c.args, 4, 2), tensor(c.args, 5)
    rope = _rope([q, k], pos.numel, q.dims[-1], table, pos)
    if len(c.args) > 12 and all(c.args[i].is_tensor for i in (9, 10, 11, 12)):
        v, k_buf, v_buf, loc = (c.args[i] for i in (9, 10, 11, 12))
        store = _cache_write([k, v], [k_buf, v_buf], loc)
        # the rotated part of k is already read by the RoPE: the store reads the rest and v
        rotated_k = k.numel // q.dims[-1] * table.dims[1]
        extra = store.bytes - formulas.elementwise_bytes(rotated_k, 0, k.b)
        return Cost(rope.kind, rope.flops, rope.bytes + extra, rope.dtype,
                    f"{rope.shape}; {store.shape}")
    return rope


def act_and_mul(c: Call) -> Cost:
    """silu_and_mul / gelu_and_mul / gelu_tanh_and_mul(out [.., I], input [.., 2I]) (vLLM,
    SGLang): act(gate) · up; reads input, writes out, the activation's FLOPs plus 1 per output
    element."""
    out, x = tensor(c.args, 0), tensor(c.args, 1)
    if 2 * out.numel != x.numel or 2 * last_dim(out) != last_dim(x):
        raise Malformed(f"{c.base} out {out.dims}, input {x.dims}: input is not [.., 2 x out]")
    per = POINTWISE_FLOPS["gelu" if "gelu" in c.base else "silu"] + 1.0
    return Io(per * out.numel, [x], out.numel, out.b, Kind.ELEMENTWISE, x.dtype).cost()


def _cache_write(sources: Sequence[Arg], caches: Sequence[Arg], slots: Arg) -> Cost:
    """Write slots.numel tokens of each source ([tokens(+padding), ..]) into its cache, at the
    cache's dtype (an fp8 cache takes 1 byte): those rows read and written, the slot indices
    read. Never the whole cache: only the slots written move. 0 FLOPs (an fp8 cache's
    scaling multiply is not counted)."""
    tokens = slots.numel
    nbytes = formulas.elementwise_bytes(slots.distinct, 0, slots.b)
    for src, cache in zip(sources, caches, strict=True):
        if not src.dims or src.dims[0] < tokens:
            raise Malformed(f"{src.dims} holds fewer than the {tokens} tokens of slot_mapping")
        moved = src.numel // src.dims[0] * tokens if tokens else 0
        nbytes += formulas.elementwise_bytes(moved, 0, src.b) + formulas.elementwise_bytes(
            0, moved, cache.b)
    shape = " ".join(str(s.dims) for s in sources) + f" -> {tokens} slots"
    return Cost(Kind.COPY, 0.0, float(nbytes), sources[0].dtype, shape)


def reshape_and_cache(c: Call) -> Cost:
    """vLLM's reshape_and_cache[_flash](key [T, n_kv, d], value [T, n_kv, d], key_cache,
    value_cache, slot_mapping [T'], kv_cache_dtype, k_scale, v_scale): `_cache_write` of the
    first T' = slot_mapping's tokens (vLLM V1 pads key for CUDA graphs, not slot_mapping),
    plus the scales."""
    key, value = tensor(c.args, 0, min_rank=1), tensor(c.args, 1, min_rank=1)
    caches = [tensor(c.args, 2), tensor(c.args, 3)]
    out = _cache_write([key, value], caches, tensor(c.args, 4, 1))
    scales = sum(formulas.elementwise_bytes(a.distinct, 0, a.b) for a in c.args[6:8] if a.is_tensor)
    return Cost(out.kind, out.flops, out.bytes + scales, out.dtype, out.shape)


def concat_and_cache_mla(c: Call) -> Cost:
    """vLLM's concat_and_cache_mla(kv_c [T, kv_lora_rank], k_pe [T, rope_dim], kv_cache
    [blocks, block_size, kv_lora_rank + rope_dim], slot_mapping [T'], kv_cache_dtype, scale):
    both parts of T' tokens written into the one cache (`_cache_write`), plus the scale."""
    kv_c, k_pe, cache = tensor(c.args, 0, 2), tensor(c.args, 1, 2), tensor(c.args, 2)
    out = _cache_write([kv_c, k_pe], [cache, cache], tensor(c.args, 3, 1))
    scale = sum(formulas.elementwise_bytes(a.distinct, 0, a.b) for a in c.args[5:6] if a.is_tensor)
    return Cost(out.kind, out.flops, out.bytes + scale, out.dtype, out.shape)


def store_kv_cache(c: Call) -> Cost:
    """SGLang's store_kv_cache(k_cache, v_cache, out_loc [T], k [T, n_kv, d], v [T, n_kv, d]):
    `_cache_write` of k and v at out_loc."""
    caches = [tensor(c.args, 0), tensor(c.args, 1)]
    loc = tensor(c.args, 2, 1)
    return _cache_write([tensor(c.args, 3, min_rank=1), tensor(c.args, 4, min_rank=1)],
                        caches, loc)


def triton_topk(c: Call) -> Cost:
    """triton_kernels' routing top-k as vLLM records it, `TopK(logits [M, E], k, ...)`: reads
    the logits, writes the k values (their dtype) and int16 indices per row and the [M, E/32]
    uint32 bitmatrix of chosen experts; one comparison per logit."""
    x = tensor(c.args, 0, 2)
    if len(c.args) < 2 or not c.args[1].concrete:
        return Cost(uncosted=f"{c.name}: k not recorded")
    k = integer(c.args[1].concrete, "TopK k")
    m, e = x.dims
    nbytes = formulas.elementwise_bytes(x.numel, m * k, x.b) + m * k * 2 + m * -(-e // 32) * 4
    return Cost(Kind.REDUCTION, float(x.numel), float(nbytes), x.dtype, f"{x.dims} top-{k}")


def triton_sort_tokens(c: Call) -> Cost:
    """triton_kernels' routing data, `SortTokens(expt_scal [M, k], expt_indx [M, k], E)`:
    reads the chosen experts and their weights, writes the gather and scatter indices (int32
    per routed row) and the E per-expert counts; no FLOPs (a sort by expert)."""
    scal, indx = tensor(c.args, 0, 2), tensor(c.args, 1, 2)
    experts = integer(c.args[2].concrete, "SortTokens E") if len(c.args) > 2 and \
        c.args[2].concrete else 0
    nbytes = (formulas.elementwise_bytes(scal.numel, 0, scal.b)
              + formulas.elementwise_bytes(indx.numel, 0, indx.b)
              + formulas.elementwise_bytes(0, 2 * indx.numel + experts, 4))
    return Cost(Kind.COPY, 0.0, float(nbytes), scal.dtype, f"{indx.dims} -> {experts} experts")


def _merged(*engines: dict[str, Rule]) -> dict[str, Rule]:
    """The engines' rules as one table (an op name two engines share has one rule)."""
    out: dict[str, Rule] = {}
    for rules in engines:
        for name, rule in rules.items():
            if out.setdefault(name, rule) is not rule:
                raise ValueError(f"engine op {name!r} given two cost rules")
    return out


_ACT_AND_MUL = dict.fromkeys(("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"), act_and_mul)
# vLLM's `_C::` and `_C_cache_ops::` ops, by base name
_VLLM: dict[str, Rule] = {
    "rms_norm": engine_rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    **_ACT_AND_MUL,
    **dict.fromkeys(("reshape_and_cache", "reshape_and_cache_flash"), reshape_and_cache),
    "concat_and_cache_mla": concat_and_cache_mla,
}
# SGLang's `sgl_kernel::` (FlashInfer's) ops by base name, its `sglang::` ops by full name
_SGLANG: dict[str, Rule] = {
    "rmsnorm": engine_rms_norm,
    "fused_add_rmsnorm": fused_add_rms_norm,
    "apply_rope_pos_ids_cos_sin_cache": apply_rope_cos_sin_cache,
    **_ACT_AND_MUL,
    "store_kv_cache": store_kv_cache,
    "sglang::store_cache": store_cache,
}
# aiter's ops (SGLang, vLLM on ROCm), by full name: other libraries' ops of the same base name
# take other arguments
_AITER: dict[str, Rule] = {
    "aiter::rms_norm": aiter_rms_norm,
    **dict.fromkeys(("aiter::add_rmsnorm", "aiter::rmsnorm2d_fwd_with_add",
                     "aiter::rmsnorm2d_fwd_with_add_ck"), add_rms_norm_out),
}
# triton_kernels' MoE routing, as vLLM records it (no namespace)
_TRITON_KERNELS: dict[str, Rule] = {"TopK": triton_topk, "SortTokens": triton_sort_tokens}
# An engine's own kernels outside aten, by full name, else base name (registry.rule_for).
ENGINE_RULES: dict[str, Rule] = _merged(_VLLM, _SGLANG, _AITER, _TRITON_KERNELS)
