"""The vLLM connector's per-source hit split (`get_external_cache_hit_sources`, vLLM's
per-tier cache-hit metrics), without an engine: each external token is counted under the tier
its block was in when the scheduler looked it up, from where the external range starts."""

from types import SimpleNamespace

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.vllm import KvtierScheduler


def split(tiers, first_block, n_tokens, bs=32):
    fake = SimpleNamespace(_tiers={"r": tiers}, _loading={"r": (first_block, [])},
                           _block_size=bs)
    return KvtierScheduler.get_external_cache_hit_sources(
        fake, SimpleNamespace(request_id="r"), n_tokens)


def test_each_external_token_counts_under_its_blocks_tier():
    # Block 0 was in the engine's own cache (device); the external range starts at block 1.
    tiers = ["host", "host", "disk", "remote"]
    assert split(tiers, 1, 96) == {CacheHitSource.HOST: 32, CacheHitSource.DISK: 32,
                                   CacheHitSource.P2P: 32}
    # A partial last block, and a range that starts at the first block.
    assert split(tiers, 0, 80) == {CacheHitSource.HOST: 64, CacheHitSource.DISK: 16}


def test_nothing_external_is_no_source_and_unknown_tiers_are_unspecified():
    assert split(["host"], 0, 0) == {}
    assert split(["host"], 0, 40) == {CacheHitSource.HOST: 32,
                                      CacheHitSource.EXTERNAL_UNSPECIFIED: 8}
    assert split(["nvme-of"], 0, 32) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 32}
