"""Each engine's load as its protocol reads it from the engine's Prometheus text.

The samples are in the engines' own shapes: the metric names, labels and HELP texts of vLLM's
`vllm/v1/metrics/loggers.py` (and of its older releases), SGLang's
`python/sglang/srt/metrics/collector.py` and `docs/references/production_metrics.md`, and
TensorRT-LLM's `tensorrt_llm/metrics/collector.py`, with the other series around them that a real
scrape carries.
"""

from __future__ import annotations

import pytest

from workers.protocols import PROTOCOLS
from workers.protocols.engine_load import MAX_SERIES_LINES, EngineLoad, LoadMetrics, read_load

VLLM = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12170.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.4375
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 8128.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-0.6B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-0.6B"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.31
"""

# vLLM before the V1 engine's rename (0.6-0.10): the KV figure is `gpu_cache_usage_perc`, no
# `engine` label.
VLLM_OLD = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.91
"""

# Data parallelism: one series per engine.
VLLM_DP = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 10.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.95
"""

SGLANG = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 24.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
# HELP sglang:num_grammar_queue_reqs The number of requests in the grammar waiting queue.
# TYPE sglang:num_grammar_queue_reqs gauge
sglang:num_grammar_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.007507552643049313
"""

TRTLLM = """\
# HELP trtllm_request_success_total Count of successfully processed requests.
# TYPE trtllm_request_success_total counter
trtllm_request_success_total{engine_type="trtllm",finished_reason="stop",model_name="nemotron-nano-3"} 42.0
# HELP trtllm_kv_cache_utilization KV cache utilization
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{engine_type="trtllm",model_name="nemotron-nano-3"} 0.625
# HELP trtllm_num_requests_running Number of active requests
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{engine_type="trtllm",model_name="nemotron-nano-3"} 8.0
# HELP trtllm_num_requests_waiting Number of queued requests
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{engine_type="trtllm",model_name="nemotron-nano-3"} 3.0
# HELP trtllm_max_num_active_requests Maximum number of active requests
# TYPE trtllm_max_num_active_requests gauge
trtllm_max_num_active_requests{engine_type="trtllm",model_name="nemotron-nano-3"} 64.0
"""


@pytest.mark.parametrize(
    ("protocol", "text", "model", "expected", "path"),
    [
        ("vllm", VLLM, "Qwen/Qwen3-0.6B", EngineLoad(waiting=7, running=3, kv_usage=0.4375), "/metrics"),
        ("vllm", VLLM_OLD, "meta-llama/Llama-3.1-8B-Instruct", EngineLoad(waiting=0, running=1, kv_usage=0.91), "/metrics"),
        ("vllm", VLLM_DP, "m", EngineLoad(waiting=11, running=6, kv_usage=0.95), "/metrics"),
        ("sglang", SGLANG, "meta-llama/Llama-3.1-8B-Instruct", EngineLoad(waiting=12, running=24, kv_usage=0.28), "/metrics"),
        ("trtllm", TRTLLM, "nemotron-nano-3", EngineLoad(waiting=3, running=8, kv_usage=0.625), "/prometheus/metrics"),
    ],
)
def test_each_engine_is_read_by_its_protocol(protocol: str, text: str, model: str, expected: EngineLoad, path: str) -> None:
    reader = PROTOCOLS[protocol]
    assert reader.metrics_path == path
    assert reader.read_load(text, model) == expected
    assert reader.read_load(text) == expected  # no model given: every series counts


def test_a_plain_openai_server_says_nothing() -> None:
    openai = PROTOCOLS["openai"]
    assert openai.metrics_path is None and openai.load_metrics is None
    assert openai.read_load(VLLM, "Qwen/Qwen3-0.6B") is None


def test_another_engines_scrape_has_no_load() -> None:
    assert PROTOCOLS["vllm"].read_load(SGLANG) is None
    assert PROTOCOLS["trtllm"].read_load(VLLM) is None
    assert PROTOCOLS["vllm"].read_load("") is None
    assert PROTOCOLS["vllm"].read_load("<html>not found</html>") is None


def test_only_the_pools_models_series_count_where_the_engine_serves_several() -> None:
    text = VLLM + 'vllm:num_requests_waiting{engine="0",model_name="other-model"} 100.0\n'
    assert PROTOCOLS["vllm"].read_load(text, "Qwen/Qwen3-0.6B") == EngineLoad(waiting=7, running=3, kv_usage=0.4375)
    # A model the engine knows by another name: all its series count.
    assert PROTOCOLS["vllm"].read_load(text, "an-alias") == EngineLoad(waiting=107, running=3, kv_usage=0.4375)


def test_a_metric_whose_name_extends_a_wanted_one_is_not_read() -> None:
    text = "vllm:num_requests_waiting_by_reason 50.0\nvllm:num_requests_waiting 2\n"
    assert read_load(text, PROTOCOLS["vllm"].load_metrics or LoadMetrics((), ())) == EngineLoad(waiting=2, running=0)


@pytest.mark.parametrize(
    "hostile",
    [
        "vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\n",
        "vllm:num_requests_waiting -5\nvllm:num_requests_running 1\n",
        "vllm:num_requests_waiting +Inf\nvllm:num_requests_running 1\n",
    ],
)
def test_values_that_are_not_counts_are_ignored(hostile: str) -> None:
    assert PROTOCOLS["vllm"].read_load(hostile) == EngineLoad(waiting=0, running=1)


def test_malformed_lines_read_as_nothing_rather_than_raise() -> None:
    assert PROTOCOLS["vllm"].read_load('vllm:num_requests_waiting{model_name="a} 3\n') is None
    assert PROTOCOLS["vllm"].read_load("vllm:num_requests_waiting{} not-a-number\n") is None


def test_a_usage_above_one_is_clamped() -> None:
    text = "sglang:num_queue_reqs 0\nsglang:num_running_reqs 0\nsglang:token_usage 1.7\n"
    assert PROTOCOLS["sglang"].read_load(text) == EngineLoad(waiting=0, running=0, kv_usage=1.0)


def test_only_so_many_series_are_parsed() -> None:
    text = "".join(f'vllm:num_requests_waiting{{engine="{i}"}} 1\n' for i in range(MAX_SERIES_LINES * 4))
    load = PROTOCOLS["vllm"].read_load(text)
    assert load is not None and load.waiting == MAX_SERIES_LINES
