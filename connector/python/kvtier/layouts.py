"""How kvtier names the dimensions of an engine's paged KV tensor (no engine import here).

A kvtier block holds an engine block's KV in one canonical order, whatever the physical layout:
``for layer: for K/V: for token: heads x head_dim`` (MLA: ``for layer: for token: latent``).
vLLM hands a connector each layer's tensor in its attention backend's *logical* shape (the
physical stride order, e.g. HND, shows only in the strides), so the roles of the dimensions
follow from that shape:

==========================  =============================  ====================================
backend                     logical shape                  roles
==========================  =============================  ====================================
FlashAttention (NHD, HND)   ``(2, blocks, tokens, H, D)``  kv, blocks, tokens, inner, inner
FlashInfer, Triton          ``(blocks, 2, tokens, H, D)``  blocks, kv, tokens, inner, inner
vLLM CPU                    ``(blocks, 2, tokens, H*D)``   blocks, kv, tokens, inner
MLA                         ``(blocks, tokens, latent)``   blocks, tokens, inner
==========================  =============================  ====================================

Every one of these gives the same canonical bytes for the same KV, so engines on different
attention backends share blocks. A shape none of these rows explains is named by a fallback
(first dimension of each size) and reported as ``"other"``: the connector then puts the exact
shape and stride order into the namespace, so such an engine only ever shares with an engine of
the very same layout (a miss otherwise, never other bytes).
"""

from __future__ import annotations

CANONICAL = "vllm-v1/kv-token-head-dim"


def kv_dims(shape, num_blocks: int | None, block_size: int) -> tuple[list[str], str]:
    """``(roles, kind)``: a role per dimension ("blocks", "kv", "tokens", "inner") and
    ``"canonical"`` when the shape is one of the known logical layouts, else ``"other"``."""
    s = list(shape)
    nb = num_blocks

    def fits(roles, want):
        return all(w is None or x == w for x, w in zip(s, want)) and len(s) == len(roles)

    known = [
        (["kv", "blocks", "tokens", "inner", "inner"], [2, nb, block_size, None, None]),
        (["blocks", "kv", "tokens", "inner", "inner"], [nb, 2, block_size, None, None]),
        (["blocks", "kv", "tokens", "inner"], [nb, 2, block_size, None]),
        (["blocks", "tokens", "inner"], [nb, block_size, None]),
    ]
    if nb is not None:
        for roles, want in known:
            if fits(roles, want):
                return roles, "canonical"
    # Fallback: the first dimension of each size, in the order blocks, kv, tokens.
    roles = ["inner"] * len(s)
    taken = set()
    for role, size in (("blocks", nb), ("kv", 2), ("tokens", block_size)):
        for j, x in enumerate(s):
            if j not in taken and size is not None and x == size:
                roles[j] = role
                taken.add(j)
                break
    if "blocks" not in roles:
        j = next(j for j in range(len(roles)) if roles[j] == "inner")
        roles[j] = "blocks"
    return roles, "other"


def layout_name(shape, strides, roles, kind: str) -> str:
    """The namespace's layout field for a tensor of this shape, strides and roles."""
    if kind == "canonical":
        return CANONICAL
    order = sorted(range(len(strides)), key=lambda j: -abs(strides[j]))
    return ("vllm-v1/shape=" + "x".join(map(str, shape)) + "/roles=" + ",".join(roles)
            + "/order=" + ",".join(map(str, order)))
