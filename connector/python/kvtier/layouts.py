"""How kvtier names the dimensions of an engine's paged KV tensor (no engine import here).

A kvtier block holds an engine block's KV in one canonical order, whatever the physical layout:
``for layer: for K/V: for token: heads x head_dim`` (MLA: ``for layer: for token: latent``).
vLLM hands a connector each layer's tensor in its attention backend's *logical* shape (the
physical stride order, e.g. HND, shows only in the strides), so the roles of the dimensions
follow from that shape:

==========================  ===============================  ==================================
backend                     logical shape                    roles
==========================  ===============================  ==================================
FlashAttention (NHD, HND)   ``(2, blocks, tokens, H, D)``    kv, blocks, tokens, inner, inner
FlashInfer, Triton          ``(blocks, 2, tokens, H, D)``    blocks, kv, tokens, inner, inner
vLLM CPU (``CPU_ATTN``)     ``(blocks, H, tokens, 2*D)``     seen as ``(blocks, H, 2, tokens,
                                                             D)``: blocks, inner, kv, tokens,
                                                             inner
MLA                         ``(blocks, tokens, latent)``     blocks, tokens, inner
==========================  ===============================  ==================================

The CPU backend's last dimension is not "K then V per token": its kernels view each head's
``tokens x 2*D`` as ``2*tokens x D`` and take the first ``tokens`` rows as K, the rest as V
(``vllm/v1/attention/backends/cpu_attn.py``, ``kv_cache.view(nb, H, 2*bs, -1).chunk(2, 2)``),
so :func:`kv_view` hands kvtier a five-dimensional view of the same memory.

Every one of these gives the same canonical bytes for the same KV, so engines on different
attention backends share blocks. A shape none of these rows explains is refused by the
connector (:func:`kv_view` reports it as ``"other"``): a layout read with the wrong roles
would store other bytes under the same keys.
"""

from __future__ import annotations

CANONICAL = "vllm-v1/kv-token-head-dim"


def kv_view(shape, strides, num_blocks: int | None,
            block_size: int) -> tuple[list[int], list[int], list[str], str]:
    """``(shape, strides, roles, kind)``: the view kvtier copies through (strides in
    elements), a role per dimension ("blocks", "kv", "tokens", "inner"), and ``"canonical"``
    when the tensor is one of the known logical layouts, else ``"other"`` (then the shape and
    strides are returned unchanged)."""
    s, st = list(shape), list(strides)
    nb = num_blocks

    def fits(want):
        return len(s) == len(want) and all(w is None or x == w for x, w in zip(s, want))

    if nb is not None:
        if fits([2, nb, block_size, None, None]):
            return s, st, ["kv", "blocks", "tokens", "inner", "inner"], "canonical"
        if fits([nb, 2, block_size, None, None]):
            return s, st, ["blocks", "kv", "tokens", "inner", "inner"], "canonical"
        # vLLM CPU: (blocks, H, tokens, 2*D), each head's tokens x 2*D contiguous.
        if fits([nb, None, block_size, None]) and s[3] % 2 == 0 and st[3] == 1 \
                and st[2] == s[3]:
            d = s[3] // 2
            return ([nb, s[1], 2, block_size, d], [st[0], st[1], block_size * d, d, 1],
                    ["blocks", "inner", "kv", "tokens", "inner"], "canonical")
        if fits([nb, block_size, None]):
            return s, st, ["blocks", "tokens", "inner"], "canonical"
    return s, st, [], "other"


def describe(shape, strides) -> str:
    """A layout kvtier does not know, for the error message: shape and stride order."""
    order = sorted(range(len(strides)), key=lambda j: -abs(strides[j]))
    return ("shape=" + "x".join(map(str, shape)) + " stride order="
            + ",".join(map(str, order)))
