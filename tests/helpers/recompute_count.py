"""What tests/scripts/count_recomputed_layers.py printed: the transformer layer forwards each rank ran again in
backward, counted apart from the profiler."""
import json
import re

SCRIPT_LINE = re.compile(r"recomputed layer forwards: (\{.*\})")


def recompute_calls(output: str) -> dict:
    """{layer 1..L: recompute calls summed over the ranks that printed}."""
    calls = {}
    for line in SCRIPT_LINE.findall(output):
        for layer, n in json.loads(line)["calls"].items():
            calls[int(layer)] = calls.get(int(layer), 0) + n
    return calls


def ranks_that_counted(output: str) -> int:
    return len(SCRIPT_LINE.findall(output))
