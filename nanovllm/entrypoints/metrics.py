"""GET /metrics: the engine's figures in Prometheus' text exposition format (version 0.0.4), written
here: the format is a few lines of text per figure, not worth a dependency (prometheus_client). Names
follow vLLM's, under the `nanovllm:` prefix, each labelled with the served model's name."""
import math

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (key in engine.stats(), metric name, type, help)
SCALARS = [
    ("num_running", "num_requests_running", "gauge", "Requests running on the engine"),
    ("num_waiting", "num_requests_waiting", "gauge", "Requests waiting for room in the KV cache"),
    ("num_used_blocks", "kv_cache_used_blocks", "gauge", "KV-cache blocks in use"),
    ("num_kvcache_blocks", "kv_cache_total_blocks", "gauge", "KV-cache blocks in all"),
    ("prefix_cache_hit_rate", "prefix_cache_hit_rate", "gauge", "Prompt tokens found in the prefix cache, "
                                                                "as a fraction of those looked up"),
    ("num_preemptions", "num_preemptions_total", "counter", "Requests preempted to free KV-cache blocks"),
    ("prompt_tokens_total", "prompt_tokens_total", "counter", "Prompt tokens received"),
    ("generation_tokens_total", "generation_tokens_total", "counter", "Tokens generated"),
    ("requests_finished_total", "request_success_total", "counter", "Requests finished"),
    # speculative decoding's (an engine with a speculative_config), as llm.stats names them
    ("spec_decode_num_drafts", "spec_decode_num_drafts_total", "counter",
     "Sequence steps verified with at least one draft"),
    ("spec_decode_draft_tokens", "spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed"),
    ("spec_decode_accepted_tokens", "spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted"),
]
HISTOGRAMS = [
    ("time_to_first_token_seconds", "Time from a request's arrival to its first token"),
    ("inter_token_latency_seconds", "Time between a request's tokens"),
    ("e2e_request_latency_seconds", "Time from a request's arrival to its end"),
]


def _number(value: float) -> str:
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def render_metrics(stats: dict, model_name: str) -> str:
    """The exposition text for one engine.stats() dict; figures it lacks are left out."""
    labels = f'model_name="{_label(model_name)}"'
    lines = []

    def family(name: str, kind: str, help_text: str) -> str:
        full = f"nanovllm:{name}"
        lines.extend([f"# HELP {full} {help_text}.", f"# TYPE {full} {kind}"])
        return full

    for key, name, kind, help_text in SCALARS:
        if stats.get(key) is not None:
            lines.append(f"{family(name, kind, help_text)}{{{labels}}} {_number(stats[key])}")
    used, total = stats.get("num_used_blocks"), stats.get("num_kvcache_blocks")
    if used is not None and total:
        lines.append(f"{family('kv_cache_usage_perc', 'gauge', 'KV-cache usage (1 = full)')}{{{labels}}} "
                     f"{_number(used / total)}")
    histograms = stats.get("histograms") or {}
    for name, help_text in HISTOGRAMS:
        histogram = histograms.get(name)
        if histogram is None:
            continue
        full = family(name, "histogram", help_text)
        for bound, count in zip(histogram["buckets"], histogram["counts"]):
            lines.append(f'{full}_bucket{{{labels},le="{_number(float(bound))}"}} {count}')
        lines.append(f'{full}_bucket{{{labels},le="+Inf"}} {histogram["count"]}')
        lines.append(f"{full}_sum{{{labels}}} {_number(float(histogram['sum']))}")
        lines.append(f"{full}_count{{{labels}}} {histogram['count']}")
    return "\n".join(lines) + "\n"
