"""bench/gpu_allocator.py's steps on the CPU with its tiny cases: a card's run of it is too rare to find its bugs."""
import json

from bench import gpu_allocator


def test_the_smoke_cases_are_predicted_measured_and_tabled(tmp_path):
    predicted = gpu_allocator.predict(smoke=True)
    assert [row["case"] for row in predicted] == [label for label, _, _ in gpu_allocator.cases(smoke=True)]
    for setting, at_run_time in (("default", False), ("expandable at run time", True)):
        gpu_allocator.measure_cases(predicted, device="cpu", out=tmp_path / f"{setting}.jsonl", at_run_time=at_run_time)
    measured = {
        setting: {record["case"]: record for record in map(json.loads, (tmp_path / f"{setting}.jsonl").read_text().splitlines())}
        for setting in ("default", "expandable at run time")
    }
    assert all("error" not in record for records in measured.values() for record in records.values())
    # Simulated for a card, each tensor rounds up to the allocator's 512-byte blocks: at least the cpu meter's count
    for row in predicted:
        assert row["predicted_bytes"] >= measured["default"][row["case"]]["process_bytes"] > 0.9 * row["predicted_bytes"]
    table = gpu_allocator.table(predicted, measured)
    assert table.count("| default |") == len(predicted) and "| expandable | " in table  # not measured: says so
    assert table.count("not measured") == len(predicted)
