"""DataParallel's less common paths: a skipped device 0, sum-reduced criteria, overrides that
call super(), and where warnings point."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp

# "cpu:1" is a device of its own to dataparallel (its replicas get private copies) while its
# tensors are CPU tensors: the paths of a second accelerator, testable without one.
OTHER = torch.device("cpu", 1)


def bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))


def test_batchnorm_statistics_update_when_device_zero_gets_no_chunk() -> None:
    torch.manual_seed(0)
    net = bn_net()
    ref = copy.deepcopy(net)
    model = dp.DataParallel(net, ["cpu", OTHER, OTHER], chunk_sizes=[0, 4, 4])
    x = torch.randn(8, 4)
    out = model(x)
    want = torch.cat([ref(x[:4]), copy.deepcopy(ref)(x[4:])])  # stats from the first chunk only
    assert out.shape == want.shape
    torch.testing.assert_close(net[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(net[1].running_var, ref[1].running_var)
    assert int(net[1].num_batches_tracked) == 1


class WritesItsState(nn.Module):
    """A forward that writes its own state: a plain counter, a name, a buffer of seen samples."""

    seen: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.calls = 0
        self.last = "none"
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.last = f"chunk of {x.shape[0]}"
        self.seen += x.shape[0]
        return self.fc(x)


@pytest.mark.parametrize(
    ("devices", "chunk_sizes"),
    [(["cpu", OTHER, OTHER], [0, 4, 3]), ([OTHER, OTHER], None), (["cpu", OTHER, OTHER], None)],
    ids=["device-0-skipped", "module-not-on-replica-0", "replica-0-is-the-module"],
)
def test_what_a_forward_writes_lands_once_whoever_is_replica_0(
    devices: list[torch.device | str], chunk_sizes: list[int] | None
) -> None:
    # Issue 42: with replica 0 not the module itself (chunk_sizes=[0, 4, 3]), buffers were
    # written back but plain attributes were not (self.calls stayed 0). Both land now, once per
    # call, from replica 0's chunk, as where replica 0 is the module.
    torch.manual_seed(0)
    net = WritesItsState()
    oracle = copy.deepcopy(net)
    model = dp.DataParallel(net, devices, chunk_sizes=chunk_sizes)
    x = torch.randn(7, 4)
    for call in (1, 2):
        torch.testing.assert_close(model(x), oracle(x))
        first = model.last_call.chunk_sizes[0]  # type: ignore[union-attr]
        assert net.calls == call
        assert net.last == f"chunk of {first}"
        assert int(net.seen) == call * first


def test_criterion_follows_a_sum_reduction() -> None:
    torch.manual_seed(1)
    lin = nn.Linear(4, 3)
    model = dp.DataParallel(lin, ["cpu"] * 3, gather=False)
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    for reduction in ("sum", "mean"):
        criterion = dp.DataParallelCriterion(nn.CrossEntropyLoss(reduction=reduction), ["cpu"] * 3)
        got = criterion(model(x), y)
        torch.testing.assert_close(got, F.cross_entropy(lin(x), y, reduction=reduction))


def test_criterion_with_waves_matches_one_device() -> None:
    torch.manual_seed(2)
    lin = nn.Linear(4, 3)
    model = dp.DataParallel(lin, ["cpu"] * 2, gather=False, max_size=2)
    x, y = torch.randn(9, 4), torch.randint(0, 3, (9,))
    outputs = model(x)
    assert len(outputs) > 2 and sum(outputs.chunk_sizes) == 9
    got = dp.DataParallelCriterion(nn.CrossEntropyLoss(), ["cpu"] * 2)(outputs, y)
    torch.testing.assert_close(got, F.cross_entropy(lin(x), y))


def test_override_calling_super_parallel_apply_gets_the_waves_devices() -> None:
    seen: list[list[torch.device]] = []

    class Logged(dp.DataParallel):
        def parallel_apply(self, replicas, inputs, kwargs):  # type: ignore[no-untyped-def]
            seen.append(list(self.__dict__["_wave_devices"]))
            return super().parallel_apply(replicas, inputs, kwargs)

    lin = nn.Linear(4, 2)
    out = Logged(lin, ["cpu", OTHER, OTHER], chunk_sizes=[0, 3, 3])(torch.randn(6, 4))
    assert seen == [[OTHER, OTHER]] and out.shape == (6, 2)


def test_warning_points_at_the_users_line() -> None:
    class Two(nn.Module):
        def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
            return x + table.sum()

    model = dp.DataParallel(Two(), ["cpu", "cpu"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(4, 2), torch.randn(1, 2))  # this line
    (warning,) = caught
    assert warning.filename == __file__


def test_warnings_of_the_free_functions_point_at_the_users_line() -> None:
    # scatter warns from its plan, gather from inside its walk: each at its own depth, and
    # both must name this file, not a frame of dataparallel or of pytest.
    calls = [
        lambda: dp.scatter((torch.randn(4, 2), torch.randn(1, 2)), ["cpu", "cpu"]),
        lambda: dp.scatter_kwargs((torch.randn(4, 2),), {"t": torch.randn(1, 2)}, ["cpu", "cpu"]),
        # an unbatched output that differs per replica, deep in a dict: concatenated
        lambda: dp.gather(
            [
                {"y": torch.zeros(3, 2), "attn": torch.zeros(4, 4)},
                {"y": torch.zeros(2, 2), "attn": torch.ones(4, 4)},
            ],
            "cpu",
        ),
        # an int equal to each chunk size on an even split (count or constant: issue 21)
        lambda: dp.gather([2, 2], "cpu", chunk_sizes=[2, 2]),
    ]
    for call in calls:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        assert caught, call
        assert all(w.filename == __file__ for w in caught), [w.filename for w in caught]


class Echo(nn.Module):
    """Returns what it was given, so a test sees exactly what reached the module."""

    def forward(self, *args: object, **kwargs: object) -> tuple[object, dict[str, object]]:
        return args, kwargs


def test_one_device_fast_path_gives_what_the_planned_path_gives() -> None:
    x, names = torch.randn(5, 2), [f"n{i}" for i in range(5)]
    table = torch.randn(1, 2)
    one = dp.DataParallel(Echo(), ["cpu"])
    (args, kwargs) = one(x, dp.Shared(table), names=names, k=3)
    assert args[0] is x and args[1] is table  # nothing copied; the marker unwrapped
    assert kwargs == {"names": names, "k": 3}
    assert one.last_call is not None and one.last_call.chunk_sizes == [5]
    # the same call through the planned path (a batch option forces it) agrees
    planned = dp.DataParallel(Echo(), ["cpu"], strict=False, chunk_sizes=[5])
    (p_args, p_kwargs) = planned(x, dp.Shared(table), names=names, k=3)
    assert torch.equal(p_args[0], x) and torch.equal(p_args[1], table) and p_kwargs == kwargs
    assert planned.last_call is not None and planned.last_call.chunk_sizes == [5]


def test_one_device_keeps_the_rules_errors_and_options() -> None:
    one = dp.DataParallel(Echo(), ["cpu"])
    empty = one(torch.zeros(0, 2))  # an empty batch: the module's own output
    assert isinstance(empty, tuple) and empty[0][0].shape == (0, 2)
    # a dp.Split decides the batch size on one device too
    with pytest.warns(UserWarning, match=r"args\[0\] has size 4 along dim 0, not the batch size 3"):
        ((_, items), _) = one(torch.zeros(4, 2), dp.Split([1, 2, 3]))
    assert items == [1, 2, 3] and one.last_call is not None
    assert one.last_call.chunk_sizes == [3]
    strict = dp.DataParallel(Echo(), ["cpu"], strict=True)
    with pytest.raises(ValueError, match=r"args\[1\]: size 1 along dim 0, expected the batch"):
        strict(torch.zeros(4, 2), torch.zeros(1, 2))
    ((half,), _) = dp.DataParallel(Echo(), ["cpu"], dtype=torch.float16)(torch.zeros(3, 2))
    assert half.dtype == torch.float16
    gen = (i for i in range(2))
    ((_, same), _) = one(torch.zeros(2, 2), gen)
    assert same is gen  # one chunk: an iterator is fine


# ----------------------------------------------------------------- max_size waves: module state


class Counting(nn.Module):
    """Writes state in forward: a plain attribute, a buffer in place, and BatchNorm's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.calls = 0
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen += x.shape[0]
        return self.bn(self.lin(x))


DEVICE_LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=["shared", "copied", "mixed"])
def test_waves_write_module_state_once_per_call_from_the_first_wave(devices: list[str]) -> None:
    # One device: forward runs once per call. Under max_size the module itself runs once, as
    # replica 0 of the first wave; later waves run on copies whose writes are dropped. So the
    # counter and num_batches_tracked step once per call, and the running statistics are those
    # of the first wave's replica 0 chunk (BatchNorm normalises each chunk on its own).
    net = Counting()
    ref = copy.deepcopy(net)
    model = dp.DataParallel(net, devices, max_size=2)
    x = torch.randn(12, 4)  # chunks of 2: BatchNorm needs two samples to train
    for call in range(1, 3):
        model(x)
        assert model.last_call is not None and model.last_call.waves > 1
        first = model.last_call.chunk_sizes[0]
        ref.bn(ref.lin(x[:first]))  # what replica 0 of the first wave saw
        assert net.calls == call
        assert int(net.bn.num_batches_tracked) == call
        assert int(net.seen) == call * first
        torch.testing.assert_close(net.bn.running_mean, ref.bn.running_mean)
        torch.testing.assert_close(net.bn.running_var, ref.bn.running_var)


class ReadsWhatItWrites(nn.Module):
    """A forward whose output reads the state it then writes: a counter, a buffer and an EMA
    teacher (a frozen copy of the student, moved toward it in place). Each write is the same
    from every chunk, so one device's state after each call is known exactly."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.student = nn.Linear(4, 3)
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        with torch.no_grad():
            self.teacher.weight.mul_(-1.0)
        self.calls = 0
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.student(x) * (1 + self.calls) + self.teacher(x) + self.seen
        self.calls += 1
        self.seen += 1.0
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.student.parameters(), strict=True):
                t.lerp_(s, 0.5)
        return out


class OwnReplicate(dp.DataParallel):
    """A subclass that overrides ``replicate`` (calling torch's step back): every replica is
    then a copy, replica 0's writes copied onto the module after the call."""

    def replicate(self, module: nn.Module, device_ids: Any) -> list[nn.Module]:
        return super().replicate(module, device_ids)


@pytest.mark.parametrize("wrapper", [dp.DataParallel, OwnReplicate], ids=["own", "overridden"])
@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=["shared", "copied", "mixed"])
def test_later_waves_read_the_state_the_call_began_with(
    devices: list[str], wrapper: type[dp.DataParallel]
) -> None:
    """Stop 77, M5 of issue 60: on one device every sample of a call sees the state the call
    began with. The later waves' copies were made after the first wave's replica 0 (the
    module) had written its counter, buffer and teacher, so they computed with the state one
    call ahead, a later wave's teacher write landed on the module too, and the third wave read
    the second's own writes: output rows off by up to 4.7 from the first call on, silently.
    With ``replicate`` overridden, every wave's copies come from one set: the counter moved 3
    times per call and the output was off by 4.7 to 8.7."""
    from _close import assert_close_rel

    net = ReadsWhatItWrites()
    ref = copy.deepcopy(net)
    model = wrapper(net, devices, max_size=2)
    x = torch.randn(12, 4)
    for call in range(1, 4):
        out = model(x)
        assert model.last_call is not None and model.last_call.waves > 1
        want = ref(x)
        assert_close_rel(out, want, msg=f"output, call {call}")
        out.square().sum().backward()
        want.square().sum().backward()
        for p, q in zip(net.student.parameters(), ref.student.parameters(), strict=True):
            assert_close_rel(p.grad, q.grad, msg=f"grad, call {call}")  # type: ignore[arg-type]
        assert net.calls == ref.calls == call
        assert_close_rel(net.seen, ref.seen, msg=f"buffer, call {call}")
        for t, r in zip(net.teacher.parameters(), ref.teacher.parameters(), strict=True):
            assert_close_rel(t, r, msg=f"teacher, call {call}")


@pytest.mark.parametrize("devices", DEVICE_LISTS, ids=["shared", "copied", "mixed"])
def test_waves_give_one_devices_outputs_and_gradients(devices: list[str]) -> None:
    from _close import assert_close_rel

    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(net)
    x = torch.randn(11, 4)
    out = dp.DataParallel(net, devices, max_size=2)(x)
    want = ref(x)
    out.square().sum().backward()
    want.square().sum().backward()
    assert_close_rel(out, want, msg="output")
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert_close_rel(p.grad, q.grad, msg="grad")  # type: ignore[arg-type]


# ----------------------------------------------------------------- nested (jagged) tensor inputs


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
@pytest.mark.parametrize(
    "devices", [["cpu"], *DEVICE_LISTS], ids=["one", "shared", "copied", "mixed"]
)
def test_a_nested_tensor_input_gets_the_rules_error_at_the_wrapper(
    devices: list[str], layout: torch.layout
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: nested tensors are a prototype
        nt = torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)], layout=layout)
    model = dp.DataParallel(nn.Linear(4, 2), devices)
    for call in (lambda: model(nt), lambda: model(x=nt), lambda: model.explain(nt)):
        with pytest.raises(TypeError, match=r"^(args\[0\]|kwargs\['x'\]): a nested tensor") as info:
            call()
        assert "list(x.unbind())" in str(info.value)
