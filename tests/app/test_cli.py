"""The ``dataparallel`` command line: train (dp and ddp), explain, bench, and its errors.

Most runs go through ``dataparallel.app.cli.main(argv)`` in this process (fast); one runs the real
entry, ``python -m dataparallel``, in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# Imported at collection: scikit-learn sets KMP_* environment variables on first import, which
# the leak check in conftest.py would pin on whichever test imported it first.
from sklearn.datasets import load_digits  # noqa: F401
from sklearn.model_selection import train_test_split  # noqa: F401

from dataparallel.app.cli import main
from dataparallel.app.demo.checkpoint import load_checkpoint, save_checkpoint
from dataparallel.app.demo.data import load_dataset, write_cifar_like
from dataparallel.app.demo.models import build_model

ERROR_PREFIX = "dataparallel: error: "


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _assert_states_close(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6, rtol=1e-5), key


def _assert_optimizers_close(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        buf_a, buf_b = a["state"][key]["momentum_buffer"], b["state"][key]["momentum_buffer"]
        assert torch.allclose(buf_a, buf_b, atol=1e-6, rtol=1e-5), key


# ------------------------------------------------------------------------------ train (dp)


def test_dp_training_matches_plain_pytorch_on_one_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, out_json = tmp_path / "run.pt", tmp_path / "run.json"
    argv = ["train", "--devices", "cpu,cpu", "--epochs", "2", "--lr", "0.05", "--seed", "3"]
    code, out, err = _run([*argv, "--checkpoint", str(ckpt), "--json", str(out_json)], capsys)
    assert code == 0, err

    # Oracle: the same run in plain PyTorch on one device (the documented epoch order:
    # randperm seeded with seed + epoch).
    data = load_dataset("digits")
    torch.manual_seed(3)
    net = build_model(data.input_shape, 10)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for epoch in range(2):
        order = torch.randperm(
            len(data.train_y), generator=torch.Generator().manual_seed(3 + epoch)
        )
        total = 0.0
        for start in range(0, len(order), 32):
            idx = order[start : start + 32]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(data.train_x[idx]), data.train_y[idx])
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        losses.append(total / len(order))

    state = load_checkpoint(ckpt)
    assert state["epoch"] == 2
    _assert_states_close(state["model"], net.state_dict())
    _assert_optimizers_close(state["optimizer"], opt.state_dict())

    figures = _json(out_json)
    assert [h["loss"] for h in figures["history"]] == pytest.approx(losses, rel=1e-4)
    assert losses[1] < losses[0]
    # The last step of an epoch is 1437 % 32 = 29 samples, split as evenly as possible.
    assert figures["last_call"]["chunk_sizes"] == [15, 14]
    assert figures["last_call"]["devices"] == ["cpu", "cpu"]
    with torch.no_grad():
        pred = net(data.test_x).argmax(dim=1)
    assert figures["test_accuracy"] == pytest.approx(float((pred == data.test_y).float().mean()))
    per_class = figures["per_class"]
    assert sum(c["total"] for c in per_class.values()) == len(data.test_y)
    assert per_class["3"]["correct"] == int(((pred == data.test_y) & (data.test_y == 3)).sum())
    # What a person sees: the table, throughput and the replicas' load.
    assert "test accuracy" in out and "samples/s" in out and "last step, per replica:" in out
    assert re.search(r"^3\s+\d\.\d{4}\s+\d+\s+\d+$", out, re.MULTILINE)


def test_resume_continues_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["train", "--devices", "cpu,cpu", "--batch-size", "64", "--lr", "0.05"]
    whole, part = tmp_path / "whole.pt", tmp_path / "part.pt"
    assert _run([*base, "--epochs", "3", "--checkpoint", str(whole)], capsys)[0] == 0
    assert _run([*base, "--epochs", "1", "--checkpoint", str(part)], capsys)[0] == 0
    assert load_checkpoint(part)["epoch"] == 1
    code, out, err = _run([*base, "--epochs", "3", "--checkpoint", str(part), "--resume"], capsys)
    assert code == 0, err
    assert "resumed from" in out and "after epoch 1" in out
    assert "epoch 1/3" not in out and "epoch 2/3" in out

    a, b = load_checkpoint(whole), load_checkpoint(part)
    assert a["epoch"] == b["epoch"] == 3
    _assert_states_close(a["model"], b["model"])
    _assert_optimizers_close(a["optimizer"], b["optimizer"])
    assert [h["loss"] for h in a["history"]] == pytest.approx([h["loss"] for h in b["history"]])
    # The checkpoint is written atomically: no temp file is left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part.pt", "whole.pt"]


def test_resume_with_other_options_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "c.pt"
    assert _run(["train", "--data", "random", "--checkpoint", str(ckpt)], capsys)[0] == 0
    argv = ["train", "--data", "random", "--checkpoint", str(ckpt), "--resume"]
    code, _, err = _run([*argv, "--batch-size", "10"], capsys)
    assert code == 2
    assert err.startswith(ERROR_PREFIX) and "--batch-size 30" in err and err.count("\n") == 1


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save_checkpoint(path, {"format": "x", "epoch": 1})

    class Unpicklable:
        def __reduce__(self) -> Any:
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        save_checkpoint(path, {"epoch": 2, "bad": Unpicklable()})
    assert torch.load(path, weights_only=True)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_cifar_folder_trains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_cifar_like(tmp_path / "cifar", n_train=60, n_test=20)
    out_json, plot = tmp_path / "f.json", tmp_path / "p.png"
    argv = ["train", "--data", f"cifar10:{folder}", "--devices", "cpu,cpu", "--epochs", "2"]
    code, out, err = _run([*argv, "--json", str(out_json), "--plot", str(plot)], capsys)
    assert code == 0, err
    figures = _json(out_json)
    assert figures["data"] == f"cifar10:{folder}" and len(figures["history"]) == 2
    assert sum(c["total"] for c in figures["per_class"].values()) == 20
    assert set(figures["per_class"]) == {
        "plane",
        "car",
        "bird",
        "cat",
        "deer",
        "dog",
        "frog",
        "horse",
        "ship",
        "truck",
    }
    assert "truck" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


_IN_MODEL = re.compile(
    r"^\tIn Model: input size torch\.Size\(\[(\d+), 5\]\) output size torch\.Size\(\[(\d+), 2\]\)$"
)
_OUTSIDE = re.compile(
    r"^Outside: input size torch\.Size\(\[(\d+), 5\]\) output_size torch\.Size\(\[(\d+), 2\]\)$"
)


def test_trace_prints_the_tutorials_sizes_on_three_replicas(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(
        ["train", "--data", "random", "--devices", "cpu,cpu,cpu", "--trace"], capsys
    )
    assert code == 0, err
    groups: list[list[int]] = []
    outside: list[int] = []
    current: list[int] = []
    for line in out.splitlines():
        if m := _IN_MODEL.match(line):
            assert m.group(1) == m.group(2)
            current.append(int(m.group(1)))
        elif m := _OUTSIDE.match(line):
            assert m.group(1) == m.group(2)
            outside.append(int(m.group(1)))
            groups.append(sorted(current, reverse=True))  # replicas print in any order
            current = []
    assert outside == [30, 30, 30, 10]
    assert groups == [[10, 10, 10]] * 3 + [[4, 3, 3]]
    assert current == []  # evaluation prints nothing


# ------------------------------------------------------------------------------ train (ddp)


def test_one_process_ddp_matches_dp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["train", "--data", "random", "--epochs", "3", "--batch-size", "16"]
    dp_ckpt, ddp_ckpt = tmp_path / "dp.pt", tmp_path / "ddp.pt"
    assert _run([*base, "--devices", "cpu", "--checkpoint", str(dp_ckpt)], capsys)[0] == 0
    ddp_json = tmp_path / "ddp.json"
    code, _, err = _run(
        [*base, "--strategy", "ddp", "--checkpoint", str(ddp_ckpt), "--json", str(ddp_json)],
        capsys,
    )
    assert code == 0, err
    a, b = load_checkpoint(dp_ckpt), load_checkpoint(ddp_ckpt)
    _assert_states_close(a["model"], b["model"])
    assert _json(ddp_json)["strategy"] == "ddp"
    assert sum(c["total"] for c in _json(ddp_json)["per_class"].values()) == 100


@pytest.mark.cuda
def test_ddp_with_more_processes_than_gpus_names_both_ways_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gpus = torch.cuda.device_count()
    argv = ["train", "--data", "random", "--strategy", "ddp", "--nproc-per-node", str(gpus + 1)]
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == ""
    assert f"--nproc-per-node {gpus}," in err and "--devices cpu" in err, err


def test_one_process_ddp_on_cpu_devices_uses_gloo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "f.json"
    argv = ["train", "--data", "random", "--strategy", "ddp", "--devices", "cpu", "--epochs", "1"]
    code, _, err = _run([*argv, "--json", str(out_json)], capsys)
    assert code == 0, err
    assert _json(out_json)["devices"] == ["cpu"]


def test_two_process_ddp_counts_every_test_sample(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "f.json"
    argv = ["train", "--data", "random", "--strategy", "ddp", "--nproc-per-node", "2"]
    argv += ["--devices", "cpu"]  # gloo on the CPU, on a GPU machine too
    code, _, err = _run(
        [*argv, "--epochs", "2", "--batch-size", "15", "--json", str(out_json)], capsys
    )
    assert code == 0, err
    figures = _json(out_json)
    assert figures["devices"] == ["cpu", "cpu"]
    # 100 samples, 50 per rank; batches of 8 and 7: 7 batches on rank 0 and 8 on rank 1 (the
    # last of 1 sample), so rank 0 takes the eighth step on zero samples.
    assert figures["last_call"]["chunk_sizes"] == [0, 1]
    assert sum(c["total"] for c in figures["per_class"].values()) == 100


def test_two_process_ddp_resumed_after_uneven_steps_is_the_same_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Batches of 8 and 7 over 50/50 samples: rank 0 has 7 batches, rank 1 has 8. Under Join
    # rank 0 skipped the eighth optimizer step, so its momentum (the one written) was not rank
    # 1's, and a resumed run drifted from the uninterrupted one (1.55 on digits).
    argv = ["train", "--data", "random", "--strategy", "ddp", "--nproc-per-node", "2"]
    argv += ["--devices", "cpu", "--batch-size", "15"]
    whole, half = tmp_path / "whole.pt", tmp_path / "half.pt"
    code, _, err = _run([*argv, "--epochs", "2", "--checkpoint", str(whole)], capsys)
    assert code == 0, err
    assert _run([*argv, "--epochs", "1", "--checkpoint", str(half)], capsys)[0] == 0
    code, _, err = _run([*argv, "--epochs", "2", "--checkpoint", str(half), "--resume"], capsys)
    assert code == 0, err
    a, b = load_checkpoint(whole), load_checkpoint(half)
    _assert_states_close(a["model"], b["model"])
    _assert_optimizers_close(a["optimizer"], b["optimizer"])
    for x, y in zip(a["history"], b["history"], strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["test_accuracy"] == y["test_accuracy"]


def test_a_resume_on_another_number_of_processes_is_refused(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # The order of the global batches depends on the number of processes: a dp checkpoint
    # resumed by ddp on 2 processes was silently another run (0.0103 off, on digits).
    ckpt = tmp_path / "one.pt"
    base = ["train", "--data", "random", "--batch-size", "16", "--checkpoint", str(ckpt)]
    assert _run([*base, "--epochs", "1"], capfd)[0] == 0
    state = load_checkpoint(ckpt)
    assert state["config"]["layout"] == {"strategy": "dp", "world_size": 1}
    before = ckpt.read_bytes()
    ddp = ["--strategy", "ddp", "--devices", "cpu", "--epochs", "2", "--resume"]
    code, _, err = _run([*base, *ddp, "--nproc-per-node", "2"], capfd)
    assert code == 2 and ckpt.read_bytes() == before
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1, err  # one line for both ranks
    assert (
        f"--resume: the checkpoint {str(ckpt)!r} was written by --strategy dp on 1 process, "
        f"this run is --strategy ddp on 2 processes: expected the checkpoint's 1 process(es)"
    ) in err
    assert "resume with --strategy dp (one process)" in err
    # dp and ddp on one process cut the data alike: the same run, resumed
    code, _, err = _run([*base, *ddp], capfd)
    assert code == 0, err
    assert load_checkpoint(ckpt)["config"]["layout"] == {"strategy": "ddp", "world_size": 1}
    # and a checkpoint of 2 processes is refused by dp, naming the way back
    state = load_checkpoint(ckpt)
    state["config"]["layout"] = {"strategy": "ddp", "world_size": 2}
    save_checkpoint(ckpt, state)
    code, _, err = _run([*base, "--epochs", "3", "--resume"], capfd)
    assert code == 2
    assert "written by --strategy ddp on 2 processes, this run is --strategy dp on 1 process" in err
    assert "resume with --strategy ddp with 2 processes" in err


def test_every_rank_runs_the_epochs_steps() -> None:
    from dataparallel.app.demo.ddp import _rank_batches, _step_totals

    # 100 samples on 2 ranks, batch 20 (10 + 10): 5 steps of 20.
    assert _step_totals(*_rank_batches(100, 2, 20)) == [20] * 5
    # batch 15 (8 + 7): rank 0 has 7 batches, rank 1 8; the eighth step is rank 1's last sample.
    assert _step_totals(*_rank_batches(100, 2, 15)) == [15] * 6 + [9, 1]
    # batch 3 on 2 ranks (2 + 1) over 50/50 samples: 50 steps, rank 0 done after 25.
    assert _step_totals(*_rank_batches(100, 2, 3)) == [3] * 25 + [1] * 25
    # 3 samples on 4 ranks: one rank has none, and still takes the one step.
    assert _step_totals(*_rank_batches(3, 4, 4)) == [3]


# ------------------------------------------------------------------------- explain, bench


def test_explain_prints_every_scenarios_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from dataparallel.app.scenarios import SCENARIOS
    from dataparallel.plan import plan

    code, out, _ = _run(["explain"], capsys)
    assert code == 0
    for name, make in SCENARIOS.items():
        s = make()
        assert f"{name}: " in out
        assert str(plan(s.inputs, s.kwargs, s.devices, **s.opts)) in out
    assert "chunk sizes: [10, 10, 10]" in out  # S4


def test_explain_one_training_batch(capsys: pytest.CaptureFixture[str]) -> None:
    from dataparallel.plan import plan

    code, out, _ = _run(["explain", "--data", "random", "--devices", "cpu,cpu,cpu"], capsys)
    assert code == 0
    batch = load_dataset("random").train_x[:30]
    assert str(plan((batch,), {}, ["cpu"] * 3)) in out


# ---------------------------------------------------------------------------------- errors


def _bad_args(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    empty = tmp_path / "empty"
    empty.mkdir()
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(os.urandom(64))
    return {
        "unknown device": (["train", "--devices", "cpu,tpu"], "--devices[1]"),
        "absent cuda device": (["train", "--devices", "cuda:99"], "--devices"),
        "no CIFAR files": (["train", "--data", f"cifar10:{empty}"], "data_batch_1"),
        "batch size 0": (["train", "--batch-size", "0"], "--batch-size"),
        "unreadable checkpoint": (
            ["train", "--checkpoint", str(garbage), "--resume"],
            "cannot be read as one",
        ),
        "missing checkpoint": (
            ["train", "--checkpoint", str(tmp_path / "none.pt"), "--resume"],
            "no such file",
        ),
        "resume without checkpoint": (["train", "--resume"], "--checkpoint"),
        "unknown data": (["train", "--data", "mnist"], "'mnist'"),
        "bad lr": (["train", "--lr", "-1"], "--lr"),
        "device list with ddp": (
            ["train", "--strategy", "ddp", "--devices", "cpu,cpu"],
            "--devices",
        ),
        "unknown scenario": (["explain", "S9"], "'S9'"),
        "no command": ([], "expected a command"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "unknown device",
        "absent cuda device",
        "no CIFAR files",
        "batch size 0",
        "unreadable checkpoint",
        "missing checkpoint",
        "resume without checkpoint",
        "unknown data",
        "bad lr",
        "device list with ddp",
        "unknown scenario",
        "no command",
    ],
)
def test_bad_options_give_one_line_and_exit_2(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, needle = _bad_args(tmp_path)[case]
    code, out, err = _run(argv, capsys)
    assert code == 2
    assert err.startswith(ERROR_PREFIX) and err.count("\n") == 1, err
    assert needle in err
    assert "Traceback" not in err + out


def test_real_entry_trains_and_reports_errors(tmp_path: Path) -> None:
    ckpt = tmp_path / "run.pt"
    env = {**os.environ, "PYTHONWARNINGS": "error::UserWarning"}
    argv = [sys.executable, "-m", "dataparallel", "train", "--devices", "cpu,cpu"]
    done = subprocess.run(
        [*argv, "--epochs", "2", "--checkpoint", str(ckpt)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    losses = [float(x) for x in re.findall(r"^epoch \d/2: loss ([\d.]+)", done.stdout, re.M)]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert load_checkpoint(ckpt)["epoch"] == 2
    bad = subprocess.run(
        [*argv, "--batch-size", "0"], capture_output=True, text=True, timeout=120, check=False
    )
    assert bad.returncode == 2
    assert bad.stderr.startswith(ERROR_PREFIX) and bad.stderr.count("\n") == 1


def test_bench_runs_the_quick_set_of_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dataparallel bench`` finds benchmarks/ beside src/ and runs its quick set; the set
    itself is exercised for real by tests/test_benchmarks.py."""
    import benchmarks.__main__ as bench

    seen: list[list[str]] = []
    monkeypatch.setattr(bench, "main", lambda argv: seen.append(argv) or 0)
    out = tmp_path / "quick.json"
    assert main(["bench", "--out", str(out)]) == 0
    assert main(["bench", "--full"]) == 0
    assert seen == [["--quick", "--out", str(out)], []]


# ------------------------------------------------------- papercuts: --overwrite, --plot, --version


def test_overwrite_replaces_an_earlier_runs_checkpoint_with_a_new_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "run.pt"
    base = ["train", "--data", "random", "--checkpoint", str(ckpt)]
    assert _run([*base, "--epochs", "2"], capsys)[0] == 0
    assert load_checkpoint(ckpt)["epoch"] == 2
    code, _, err = _run([*base, "--epochs", "1", "--lr", "0.05"], capsys)
    assert code == 2 and "--overwrite" in err
    assert load_checkpoint(ckpt)["epoch"] == 2  # refused: the earlier run is intact
    code, _, err = _run([*base, "--epochs", "1", "--lr", "0.05", "--overwrite"], capsys)
    assert code == 0, err
    state = load_checkpoint(ckpt)
    assert state["epoch"] == 1 and state["config"]["lr"] == 0.05


@pytest.mark.parametrize(("suffix", "magic"), [(".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_plot_writes_the_format_its_suffix_names(
    suffix: str, magic: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / f"curves{suffix}"
    assert _run(["train", "--data", "random", "--plot", str(plot)], capsys)[0] == 0
    assert plot.read_bytes().startswith(magic)


def test_version_prints_the_package_and_torch_versions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"dataparallel {version('dataparallel')} (torch {torch.__version__}")


@pytest.mark.parametrize("value", ["abc", "1e20", "0"])
def test_a_bad_dist_timeout_is_one_line_before_the_launch(value: str) -> None:
    """Issue 51: ``DATAPARALLEL_DIST_TIMEOUT=abc`` under ``--strategy ddp`` ended with one or
    two tracebacks and the launcher's summary (28 to 55 lines, exit 1); it is a usage error,
    said once before any worker starts, as a bad option is."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["DATAPARALLEL_DIST_TIMEOUT"] = value
    argv = [sys.executable, "-m", "dataparallel", "train", "--strategy", "ddp", "--devices"]
    for procs in ("1", "2"):
        done = subprocess.run(
            [*argv, "cpu", "--nproc-per-node", procs, "--epochs", "1"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(ERROR_PREFIX) and done.stderr.count("\n") == 1, done.stderr
        assert "DATAPARALLEL_DIST_TIMEOUT" in done.stderr and repr(value) in done.stderr


def test_ddp_batchnorm_with_a_one_sample_batch_is_refused_up_front(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Issue 51, item 7: rank 1's shard of digits (718 samples) in batches of 3 ends in one
    sample, and BatchNorm ended the job there with 60 lines of tracebacks. Now one line and
    exit 2 before any worker starts, naming a batch size that works."""
    argv = ["train", "--strategy", "ddp", "--devices", "cpu", "--nproc-per-node", "2"]
    code, _, err = _run([*argv, "--batchnorm", "--batch-size", "6", "--epochs", "1"], capfd)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "rank 1 a last batch of 1 sample" in err and "use --batch-size 8" in err


def test_the_batch_size_the_refusal_names_has_no_lone_sample() -> None:
    from dataparallel.app.demo.ddp import _lone_sample, check_batchnorm_batches
    from dataparallel.app.demo.options import UsageError

    assert _lone_sample(1437, 2, 6) == 1 and _lone_sample(1437, 2, 8) is None
    check_batchnorm_batches(1437, 2, 8, "chunk")
    check_batchnorm_batches(1437, 2, 6, "none")  # no BatchNorm: nothing to refuse
    with pytest.raises(UsageError, match="--batch-size 8"):
        check_batchnorm_batches(1437, 2, 6, "chunk")
