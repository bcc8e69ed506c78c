"""What the trainer reports: model FLOPs per token, the MFU peak, comm time as a union of spans,
the metrics log the plot reads."""
import pytest

from megaloom.models.hf_moe import build_model
from megaloom.runtime.errors import ConfigError
from megaloom.train.flops import flops_per_token, peak_flops
from megaloom.train.parallel.clock import CommClock
from megaloom.train.plot import plot_metrics, read_metrics

from .tiny import tiny_config


def test_flops_per_token_counts_weights_routed_experts_and_attention(tmp_path):
    model = build_model(tiny_config(tmp_path)["model"], 0)  # hidden 64, 4 heads of 16, 2 KV heads, 8 experts top-2
    attention = 64 * 64 + 32 * 64 + 32 * 64 + 64 * 64      # q, k, v, o
    experts = (8 * 64 * 64 + 8 * 64 * 32) * 2 / 8           # gate_up [E, 2I, H] and down [E, H, I]: top-2 of 8
    weights = 2 * (attention + 8 * 64 + experts) + 128 * 64  # 2 layers (router 8 x 64), lm_head
    scores = 2 * 2 * 16 * 4 * (16 + 16)                      # 2 x layers x seq x heads x (qk + v head dims)
    assert flops_per_token(model, seq_len=16) == 3 * (2 * weights + scores)


def test_peak_flops_from_profiles():
    peak, source = peak_flops("cpu", "float32")
    assert peak == 1.0e11 and source == "hardware profile 'cpu', peak.cube fp32 (estimate: AVX2 FMA fp32; " \
        "bf16/fp16 without native support)"
    assert peak_flops("h100", "bfloat16")[0] > 1e14 and peak_flops(None, "float32") == (None, "no hardware profile")
    assert peak_flops("auto", "float32") == peak_flops("cpu", "float32")  # no CUDA here
    with pytest.raises(ConfigError, match="unknown hardware profile 'tpu9'"):
        peak_flops("tpu9", "float32")


def test_comm_clock_counts_overlapping_spans_once():
    clock = CommClock()
    for span in [(0.0, 1.0), (0.5, 1.5), (3.0, 3.25), (1.25, 1.4)]:
        clock.add(*span)
    assert clock.take() == pytest.approx(1.75)
    assert clock.take() == 0.0


def test_plot_reads_metrics_and_names_bad_lines(tmp_path):
    good = tmp_path / "metrics.jsonl"
    good.write_text('{"step": 1, "loss": 4.0, "tokens_per_s": 100}\n{"step": 2, "loss": 3.5, "tokens_per_s": 120}\n')
    plot_metrics(good, tmp_path / "m.png")
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 4.0, "tokens_per_s": 100}\n{"step": 2\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not a JSON record"):
        read_metrics(bad)
    bad.write_text('\n{"step": 2\n')  # blank lines are skipped, yet counted
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not a JSON record"):
        read_metrics(bad)
    bad.write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: a metrics record needs step, loss and tokens_per_s"):
        read_metrics(bad)
    with pytest.raises(ConfigError, match="cannot read metrics"):
        read_metrics(tmp_path / "none.jsonl")
