"""The pure helpers of scripts/bench_paired.py and scripts/profile_step.py (the runs are scripts, not tests)."""

from __future__ import annotations

import pytest
from shardpool_dev.bench import paired, profile, stats


def test_runs_alternate_a_and_b_and_every_other_pair_starts_with_b() -> None:
    assert stats.run_order(3) == [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B")]


def test_pair_ratios_divide_each_a_by_its_own_b() -> None:
    assert stats.pair_ratios([100.0, 90.0, 60.0], [100.0, 100.0, 50.0]) == [1.0, 0.9, 1.2]
    with pytest.raises(ValueError):
        stats.pair_ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        stats.pair_ratios([], [])


def test_ratio_summary_reports_median_and_spread() -> None:
    summary = stats.ratio_summary([0.98, 1.02, 0.95, 1.01, 0.99])
    assert summary["median"] == pytest.approx(0.99)
    assert summary["min"] == pytest.approx(0.95)
    assert summary["max"] == pytest.approx(1.02)
    assert summary["spread"] == pytest.approx(0.07)


ANCHOR = profile.STEP_ANCHORS["A"]
STEP = f"{ANCHOR}:287)"


def _stack(*frames: str) -> list[str]:
    return ['process 1:"python"', "main (worker.py:60)", STEP, *frames]


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        (("StagePipe.run_schedule (shardpool/train/pipeline.py:56)", "StagePipe.forward (shardpool/train/pipeline.py:66)", "Module._call_impl (torch/nn/modules/module.py:1789)", "_gemm_4bit_default_impl (bitsandbytes/backends/default/ops.py:342)"), "forward"),
        (("StagePipe.backward (shardpool/train/pipeline.py:83)", "Tensor.backward (torch/_tensor.py:630)", "_engine_run_backward (torch/autograd/graph.py:841)"), "backward"),
        (("AdamW.step (torch/optim/adamw.py:220)", "_single_tensor_adamw (torch/optim/adamw.py:400)"), "optimizer"),
        (("reduce_and_clip_gradients (shardpool/train/loss.py:80)",), "gradient clip"),
        (("gather_timings (shardpool/train/loss.py:110)",), "collectives"),
        (("emit (shardpool/train/worker.py:97)",), "logging"),
        (("StagePipe.forward (shardpool/train/pipeline.py:70)",), "python overhead"),
        (("StagePipe.forward (shardpool/train/pipeline.py:66)", "PipelineStage.forward (shardpool/model/stage.py:121)"), "python overhead"),
        ((), "python overhead"),
    ],
)  # fmt: skip
def test_samples_fall_in_the_category_of_their_stack(frames: tuple[str, ...], expected: str) -> None:
    assert profile.categorize(_stack(*frames), ANCHOR) == expected


def test_samples_outside_the_step_loop_are_left_out() -> None:
    assert (
        profile.categorize(
            ['process 1:"python"', "StageWorker.setup (shardpool/train/worker.py:170)"], ANCHOR
        )
        is None
    )


def test_breakdown_counts_and_shares_from_raw_lines() -> None:
    raw = [
        f'process 1:"python";{STEP};StagePipe.forward (shardpool/train/pipeline.py:66);Module._call_impl (torch/nn/modules/module.py:1789) 6\n',
        f'process 1:"python";{STEP};AdamW.step (torch/optim/adamw.py:220) 2\n',
        'process 1:"python";_find_and_load (<frozen importlib._bootstrap>:1176) 9\n',
        "\n",
    ]
    report = profile.breakdown(profile.parse_raw(raw), ANCHOR)
    assert report["samples"] == 8
    assert report["counts"] == {"forward": 6, "optimizer": 2}
    assert report["share"] == {"forward": 0.75, "optimizer": 0.25}


def test_a_third_side_runs_in_every_pair() -> None:
    assert stats.run_order(2, ("A", "B", "C")) == [
        (0, "A"),
        (0, "B"),
        (0, "C"),
        (1, "C"),
        (1, "B"),
        (1, "A"),
    ]


def test_peak_memory_is_the_device_peak_where_there_is_one() -> None:
    assert paired.peak_memory({"peak_rss_bytes": 700, "peak_device_bytes": None}) == 700
    assert paired.peak_memory({"peak_rss_bytes": 700}) == 700
    assert paired.peak_memory({"peak_rss_bytes": 700, "peak_device_bytes": 5000}) == 5000


def test_the_pytorch_nf4_bound_is_a_layers_widest_linear_in_its_compute_dtype() -> None:
    llama_8b = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "head_dim": 128}
    assert paired.dequantized_linear_bytes(llama_8b, compute_bytes=2) == 4096 * 14336 * 2  # 112 MiB
    # an attention projection wider than the MLP (head_dim x heads above hidden) sets the bound
    wide_attention = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "head_dim": 32}
    assert paired.dequantized_linear_bytes(wide_attention, compute_bytes=4) == 64 * 128 * 4
