"""Recording the decode steps' groupings of rows that share pages (engine/shared_prefixes.py) in engine tests."""
from nanovllm.engine import step_inputs


def record_groupings(monkeypatch) -> list:
    """From now on, every grouping step_inputs computes (shared_prefixes' answer: None where it groups nothing),
    in order, appended to the returned list."""
    grouped = []
    original = step_inputs.shared_prefixes

    def recording(*args, **kwargs):
        grouped.append(original(*args, **kwargs))
        return grouped[-1]
    monkeypatch.setattr(step_inputs, "shared_prefixes", recording)
    return grouped
