"""The hybrid hit rule of the vLLM connector against a real (embedded) store, without an
engine: a full-attention group needs every block before the hit's end, a sliding-window group
only the window right before it; a missing block moves the end back to where every group can
use it."""

from types import SimpleNamespace

import kvtier
from kvtier.vllm import KvtierScheduler, _Group, namespace

BS = 32


def connector(windows):
    """A connector with one group per window (0: full attention), keyed in namespaces of their
    own, over a real embedded store."""
    c = object.__new__(KvtierScheduler)
    c._block_size = BS
    c._store = kvtier.Store(16 << 20, segment_bytes=4 << 20)
    c._groups = []
    for g, w in enumerate(windows):
        enc, fp = namespace("m", None, "float32", BS, layout=f"nhd|group{g}:{w}")
        c._groups.append(_Group([f"l{g}"], w, enc, fp, c._store.register_namespace(enc)))
    c._hybrid = True
    return c


def request(blocks, extra_tokens=5):
    hashes = [bytes([i + 1]) * 32 for i in range(blocks)]
    return SimpleNamespace(block_hashes=hashes,
                           prompt_token_ids=list(range(blocks * BS + extra_tokens)))


def store(c, g, req, which):
    for i in which:
        key = kvtier.engine_key(c._groups[g].fp, req.block_hashes[i])
        assert c._store.put(c._groups[g].ns, key, bytes([i]) * 4096)


def test_sliding_window_needs_only_its_window_before_the_end():
    c = connector([2, 0])  # group 0: a 2-block window; group 1 (primary): full attention
    req = request(10)
    store(c, 1, req, range(10))
    store(c, 0, req, [8, 9])
    assert c._primary() is c._groups[1]
    assert c._hybrid_hit(req, 10) == 10
    # A hole below the window does not matter; one inside it moves the end below the hole,
    # where the window must be complete again.
    store(c, 0, req, [3, 4, 5])
    assert c._hybrid_hit(req, 10) == 10
    c._store.clear_namespace(c._groups[0].ns)
    store(c, 0, req, [3, 4, 5, 6, 7, 9])
    assert c._hybrid_hit(req, 10) == 8  # block 8 missing: the window [6, 8) is there
    # The primary group's prefix bounds it, and the window follows the new end.
    assert c._hybrid_hit(req, 5) == 5
    assert c._hybrid_hit(req, 3) == 0  # the window before 3 would be [1, 3): missing
    # A window that runs into the first block counts from block 0.
    store(c, 0, req, [0])
    assert c._hybrid_hit(req, 1) == 1


def test_the_hit_is_whole_blocks_one_short_of_the_prompt_end():
    c = connector([0, 1])
    req = request(4, extra_tokens=0)  # exactly 4 blocks: the last token must be computed
    store(c, 0, req, range(4))
    store(c, 1, req, range(4))
    assert c._hybrid_hit(req, 4) == 3


def test_every_full_attention_group_bounds_the_hit():
    c = connector([0, 0, 3])
    req = request(8)
    store(c, 0, req, range(8))
    store(c, 1, req, range(6))  # a second full-attention group with a shorter prefix
    store(c, 2, req, range(8))
    assert c._hybrid_hit(req, 8) == 6
