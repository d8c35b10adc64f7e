"""Peak RSS of a Kimi-shaped extraction: within the model + 2x one batch's features, whatever the shard size.

The measurement is benchmarks/extract_memory.py's (the real `python -m extract` in child processes,
peak RSS from ru_maxrss), at a smaller scale: 8 conversations of ~950 tokens, 2,048-token batches
(two samples each), fp8 storage, shards of 2 samples and of all 8. The whole-shard writer this replaced
held every sample's fp32 features (611 MiB here) and failed it: 1,114 and 1,514 MiB against a 997 MiB
budget, where this code peaks at 829 and 868 MiB (`benchmarks/extract_memory.py --samples 8 --words 240
--batch-tokens 2048 --max-length 2048 --shard-sizes 2,8`, with and without `--code` of main).
"""

from __future__ import annotations

from extract_memory import measure
from helpers_paths import ROOT


def test_peak_rss_stays_within_two_batches_of_features_whatever_the_shard_size(tmp_path):
    report = measure(ROOT, tmp_path, samples=8, words=240, batch_tokens=2048, max_length=2048, shard_sizes=[2, 8])
    small, big = report["runs"]
    assert (small["shards"], big["shards"]) == (4, 1)
    assert big["shard_tokens"] > 3 * report["batch_tokens"]  # the big shard spans many batches
    # the whole dataset's fp32 features are far over the budget: holding a shard would not fit
    assert report["dataset_feature_bytes_fp32"] > 3 * report["batch_feature_bytes"]
    for run in report["runs"]:
        assert run["peak_rss"] <= report["budget"], (run, report)
    # and the peak does not grow with the shard: 4x more samples per shard, within one batch's features
    # (allocator noise is ~0.2 of a batch here; holding the shard would add ~2.7 batches)
    assert big["peak_rss"] - small["peak_rss"] <= report["batch_feature_bytes"], report
