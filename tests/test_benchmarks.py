"""Smoke test of the benchmark suite: the quick set runs and its JSON has the documented shape.

Timings are not asserted (the machine is shared); what is checked is that every case ran or
says why not, that each figure is a positive number with its spread, and that ratios and
verdicts agree with the figures they come from.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from benchmarks.__main__ import main
from benchmarks.cases import FULL, QUICK, _by_hand, _ours, case_compile, heterogeneous_batch
from benchmarks.e2e import Floor, case_e2e, tiny_mlp
from benchmarks.harness import (
    SCHEMA,
    Case,
    Settings,
    Stats,
    compare,
    merge_runs,
    paired_ratio,
)
from benchmarks.phases import case_phases

QUICK_NAMES = {
    "scatter_gather_hetero",
    "plan_scaling",
    "plan_cached_dict100",
    "plan_cached_tensors",
    "dp_one_replica_train_step",
    "replicate_2x_inference",
    "replicate_2x_training",
    "replicate_4x_inference",
    "replicate_4x_training",
    "replicate_2x_training_copy",
    "replicate_4x_training_copy",
    "replicate_2x_neighbour_writes",
    "replicate_2x_one_module_written",
    "replicate_2x_miss",
    "syncbn_2x_train_step",
}


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    code = main(
        ["--quick", "--repeats", "3", "--min-time", "0.002", "--warmup", "1", "--out", str(out)]
    )
    assert code == 0
    return json.loads(out.read_text())


def test_quick_report_has_machine_and_settings(quick_report: dict) -> None:
    assert quick_report["schema"] == SCHEMA
    assert quick_report["suite"] == "quick"
    machine = quick_report["machine"]
    for key in ("cpu_count", "platform", "python", "torch", "device", "torch_threads"):
        assert machine[key] not in (None, ""), key
    assert quick_report["settings"]["repeats"] == 3
    assert quick_report["settings"]["interleaved"] is True


def test_quick_report_covers_every_quick_case(quick_report: dict) -> None:
    names = {c["name"] for c in quick_report["cases"]}
    assert names == QUICK_NAMES
    summary = quick_report["summary"]
    assert sum(summary.values()) == len(quick_report["cases"])


def test_each_case_has_stats_ratio_and_verdict_consistent(quick_report: dict) -> None:
    for case in quick_report["cases"]:
        assert case["status"] == "ok", case["skipped_reason"]
        stats = case["stats"]
        assert case["measured"] in stats and case["baseline"] in stats
        for s in stats.values():
            assert s["n"] == 3 and len(s["samples_s"]) == 3
            assert 0 < s["min_s"] <= s["q1_s"] <= s["median_s"] <= s["q3_s"] <= s["max_s"]
            assert s["median_s"] == pytest.approx(statistics.median(s["samples_s"]))
            assert s["iqr_s"] == pytest.approx(s["q3_s"] - s["q1_s"])
        m, b = stats[case["measured"]], stats[case["baseline"]]
        per_repeat = [x / y for x, y in zip(m["samples_s"], b["samples_s"], strict=True)]
        assert case["ratio"] == pytest.approx(statistics.median(per_repeat))
        assert case["ratio_of_medians"] == pytest.approx(m["median_s"] / b["median_s"])
        target = case["target"]
        if target is None:
            assert case["met"] is None
        elif target["op"] == "<=":
            assert case["met"] == (case["ratio"] <= target["value"])
        elif target["op"] == "in":
            low, high = target["value"]
            assert case["met"] == (low <= case["ratio"] <= high)


def test_plan_scaling_reports_per_leaf_times(quick_report: dict) -> None:
    case = next(c for c in quick_report["cases"] if c["name"] == "plan_scaling")
    per_leaf = case["extra"]["seconds_per_leaf"]
    assert set(per_leaf) == {"1", "10", "100", "1000", "10000"}
    for n, seconds in per_leaf.items():
        assert seconds == pytest.approx(case["stats"][f"{n} leaves"]["median_s"] / int(n))
    assert math.isfinite(case["extra"]["loglog_slope_100_to_10000"])


def test_replicate_cases_name_their_module_and_replicas(quick_report: dict) -> None:
    for case in quick_report["cases"]:
        if case["name"].startswith("replicate_"):
            assert case["extra"]["modules"] >= 200
            assert case["extra"]["replicas"] == int(case["name"].split("_")[1][0])


def test_hand_written_floor_equals_our_round_trip() -> None:
    # The floor is only a fair baseline if it does the same work: same values, same order.
    batch = heterogeneous_batch(20)
    ours, hand = _ours(batch, ["cpu", "cpu"]), _by_hand(batch, ["cpu", "cpu"])
    assert ours[0].equal(hand[0]) and ours[3].equal(hand[3])
    assert all(a.equal(b) for a, b in zip(ours[1], hand[1], strict=True))
    assert ours[2] == hand[2] == batch[2]
    assert ours[4].keys() == hand[4].keys()
    assert all(ours[4][k].equal(hand[4][k]) for k in ours[4])


def test_compare_interleaves_and_paired_ratio_is_median_of_pairs() -> None:
    calls: list[str] = []
    stats = compare(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        Settings(repeats=4, min_block_s=1e-9, warmup=0),
    )
    # calibration: one call each; then the order alternates ab, ba, ab, ba
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert stats["a"].n == stats["b"].n == 4
    fake_m = Stats.of([2.0, 4.0, 9.0], 1)
    fake_b = Stats.of([1.0, 1.0, 3.0], 1)
    assert paired_ratio(fake_m, fake_b) == (3.0, 4.0 / 1.0)


def test_case_verdicts() -> None:
    assert Case("x", "t", ratio=1.5, target=2.0).met is True
    assert Case("x", "t", ratio=0.95, op=">=", target=0.97).met is False
    assert Case("x", "t", ratio=11.0, op="in", target=[7.5, 12.5]).met is True
    assert Case("x", "t", ratio=1.0).met is None
    assert Case("x", "t", skipped="why").to_json()["status"] == "skipped"


def test_quick_set_is_the_documented_one() -> None:
    assert [f.__name__ for f in QUICK] == [
        "case_scatter_gather",
        "case_plan_scaling",
        "case_plan_cache",
        "case_train_step",
        "case_replicate",
        "case_syncbn",
    ]


def test_bad_arguments_exit_with_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--quick", "--repeats", "0", "--out", str(tmp_path / "x.json")])
    assert info.value.code == 2
    assert not (tmp_path / "x.json").exists()


def test_full_set_times_dataparallel_end_to_end() -> None:
    assert case_e2e in FULL and case_e2e not in QUICK


def test_floor_equals_the_plain_module_and_trains_it_alike() -> None:
    # The floor is a fair baseline only if it computes what the module does, gradients too.
    torch.manual_seed(0)
    module = tiny_mlp()
    x = torch.randn(13, 32)  # uneven chunks on 4 replicas
    floor = Floor(module, 4)
    try:
        out = floor(x)
        torch.testing.assert_close(out, module(x), atol=1e-5, rtol=0)
        out.sum().backward()
        grads = [p.grad.clone() for p in module.parameters()]
        module.zero_grad()
        module(x).sum().backward()
        for g, p in zip(grads, module.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=0)
        with torch.no_grad():
            assert not floor(x).requires_grad  # the caller's grad mode reaches the threads
    finally:
        floor.close()
    assert not any(t.is_alive() for t in floor.threads)


def test_e2e_cases_report_ratios_overheads_and_verdicts() -> None:
    cases = case_e2e(Settings(repeats=3, min_block_s=0.002, warmup=1), replicas=(1, 2, 4))
    names = [c.name for c in cases]
    for model in ("mlp", "cnn"):
        for mode in ("inference", "training"):
            for n in (1, 2, 4):
                assert f"e2e_{model}_{mode}_{n}x" in names
    for mode in ("inference", "training"):
        assert f"e2e_mlp_{mode}_overhead_us" in names
        assert f"e2e_mlp_{mode}_per_replica_us" in names
    for case in cases:
        stats = case.stats
        assert set(stats) == {"DataParallel", "floor", "plain"}
        if case.name.endswith("x"):
            ratio, _ = paired_ratio(stats["DataParallel"], stats["floor"])
            assert case.ratio == pytest.approx(ratio)
            to_plain, _ = paired_ratio(stats["DataParallel"], stats["plain"])
            assert case.extra["ratio_to_plain"] == pytest.approx(to_plain)
            diffs = [
                m - b
                for m, b in zip(stats["DataParallel"].samples, stats["floor"].samples, strict=True)
            ]
            assert case.extra["overhead_us"] == pytest.approx(statistics.median(diffs) * 1e6)
        else:
            assert case.met is not None  # µs cases carry a target, so a verdict
    mlp_two = next(c for c in cases if c.name == "e2e_mlp_inference_2x")
    assert mlp_two.target == 1.3 and mlp_two.met is not None


def test_full_set_times_the_clis_own_ddp_path() -> None:
    from benchmarks.bench_train_ddp import command
    from benchmarks.cases import case_train_ddp

    assert case_train_ddp in FULL and case_train_ddp not in QUICK
    ours = command("ours", 100, 2, Path("f.json"))
    # the command a user runs, not a hand-written loop
    assert ours[1:] == [
        "-m",
        "dataparallel",
        "train",
        "--strategy",
        "ddp",
        "--nproc-per-node",
        "2",
        "--devices",
        "cpu",
        "--data",
        "random",
        "--epochs",
        "100",
        "--no-progress",
        "--json",
        "f.json",
    ]
    assert command("raw", 100, 2, Path("f.json"))[1:3] == ["-m", "torch.distributed.run"]


@pytest.mark.slow
def test_train_ddp_rounds_report_both_sides_and_their_paired_ratio() -> None:
    from benchmarks.bench_train_ddp import TARGET, run_rounds

    # One round (two launches of two processes each): the shape and the arithmetic, not speed.
    report = run_rounds(rounds=1, epochs=2, echo=False)
    runs = report["runs"]
    assert set(runs) == {"ours", "raw"} and all(len(r) == 1 for r in runs.values())
    for side in runs.values():
        for run in side:
            assert run["samples_per_s"] > 0 and run["wall_s"] > 0
    ratios = [
        o["samples_per_s"] / r["samples_per_s"]
        for o, r in zip(runs["ours"], runs["raw"], strict=True)
    ]
    assert report["ratios"] == pytest.approx(ratios)
    assert report["ratio"] == pytest.approx(statistics.median(ratios))
    assert report["met"] == (report["ratio"] >= TARGET)
    assert report["load_average_1min"]["max"] is not None


def test_full_set_times_compiled_replicas_against_eager() -> None:
    """The compile= row (inductor in the full run; the eager backend here, which compiles in a
    second): both contenders timed, the ratio their paired figure, no target."""
    assert case_compile in FULL and case_compile not in QUICK
    (case,) = case_compile(Settings(repeats=2, min_block_s=0.001, warmup=1), {"backend": "eager"})
    assert case.name == "dp_compile_train_step" and case.skipped is None
    assert set(case.stats) == {"compiled", "eager"} and case.baseline == "eager"
    assert case.ratio is not None and case.ratio > 0 and case.target is None


def test_merge_runs_keeps_each_cases_median_run_with_the_spread() -> None:
    runs = [
        [Case("a", "t", ratio=1.3, target=1.25), Case("s", "t", skipped="no mmcv")],
        [Case("a", "t", ratio=1.1, target=1.25), Case("s", "t", skipped="no mmcv")],
        [Case("a", "t", ratio=1.2, target=1.25), Case("s", "t", skipped="no mmcv")],
    ]
    merged = merge_runs(runs)
    assert [c.name for c in merged] == ["a", "s"]
    a = merged[0]
    assert a.ratio == 1.2 and a.met is True  # the median run's ratio decides the verdict
    assert a.extra["runs"] == {"ratios": [1.3, 1.1, 1.2], "median": 1.2, "spread": [1.1, 1.3]}
    assert runs[2][0].extra == {}  # the runs' own cases are not changed
    assert merged[1].skipped == "no mmcv" and "runs" not in merged[1].extra


def test_runs_flag_reports_every_run_and_refuses_zero(tmp_path: Path) -> None:
    from benchmarks.__main__ import run

    ran: list[int] = []

    def case_probe(settings: Settings) -> list[Case]:
        ran.append(1)
        return [Case("x", "t", ratio=float(len(ran)))]  # 1.0, 2.0, 3.0: median 2.0

    report = run(
        (case_probe,),
        Settings(repeats=1, min_block_s=1e-6, warmup=0),
        tmp_path / "three.json",
        name="probe",
        echo=False,
        runs=3,
    )
    assert len(ran) == 3 and report["settings"]["runs"] == 3 and len(report["runs"]) == 3
    (case,) = report["cases"]
    assert case["ratio"] == 2.0 and case["extra"]["runs"]["spread"] == [1.0, 3.0]
    with pytest.raises(SystemExit) as info:
        main(["--quick", "--runs", "0", "--out", str(tmp_path / "x.json")])
    assert info.value.code == 2


def test_full_set_times_the_phases_and_holds_the_cnn_to_its_target() -> None:
    assert case_phases in FULL and case_phases not in QUICK
    cases = case_e2e(Settings(repeats=1, min_block_s=0.001, warmup=1), replicas=(2,))
    targets = {c.name: c.target for c in cases if c.name.endswith("_2x")}
    assert targets == {
        "e2e_mlp_inference_2x": 1.3,
        "e2e_mlp_training_2x": 1.3,
        "e2e_cnn_inference_2x": 1.05,
        "e2e_cnn_training_2x": 1.05,
    }


def test_phases_time_ours_beside_the_floor_and_restore_what_they_wrap() -> None:
    from benchmarks.phases import PHASES, measure

    import dataparallel.wrapper._data_parallel as wrapper_module
    from dataparallel.scatter._plans import PlanCache

    before = (vars(PlanCache)["find"], vars(wrapper_module.DataParallel)["__call__"])
    found = measure("mlp", "training", repeats=1, calls=3)
    table = found["us"]
    for key in ("serial Python before the hand-off", "serial Python after the join"):
        assert table[key]["ours"] > 0 and table[key]["floor"] > 0
    for label, _, _ in PHASES:
        assert table[label]["ours"] > 0, label  # every phase ran inside the warm calls
    # the serial parts are parts of the call
    assert table["serial Python before the hand-off"]["ours"] < table["whole call"]["ours"]
    after = (vars(PlanCache)["find"], vars(wrapper_module.DataParallel)["__call__"])
    assert after == before  # the timers are gone
