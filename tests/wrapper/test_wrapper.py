"""DataParallel end to end, with the oracle pattern: the same module on one device is the
reference for outputs, gradients and training."""

from __future__ import annotations

import copy
import dataclasses
import threading
import traceback
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import dataparallel as dp
from dataparallel.app.demo.models import Net


@dataclasses.dataclass
class Extra:
    embedding: torch.Tensor
    names: list[str]


class DictModel(nn.Module):
    """Returns a dict holding a dataclass, a per-sample list of strings and a scalar loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.num_classes = 10  # no chunk size: one equal to it reads as a count (issue 21)

    def forward(self, x: torch.Tensor, names: list[str], y: torch.Tensor) -> dict[str, Any]:
        logits = self.fc(x)
        return {
            "logits": logits,
            "extra": Extra(torch.tanh(logits), [n.upper() for n in names]),
            "loss": F.cross_entropy(logits, y),
            "num_classes": self.num_classes,
        }


class ListModel(nn.Module):
    """Records how many per-sample arrays each replica received (seed 000)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []
        self.lock = threading.Lock()

    def forward(self, arrays: list[np.ndarray]) -> list[float]:
        with self.lock:
            self.seen.append(len(arrays))
        return [float(a.sum()) for a in arrays]


def mlp_bn() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def bn_stats(module: nn.Sequential) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Running mean, running variance and batch count of ``mlp_bn``'s BatchNorm."""
    bn = module[1]
    assert isinstance(bn, nn.BatchNorm1d)
    assert bn.running_mean is not None and bn.running_var is not None
    assert bn.num_batches_tracked is not None
    return bn.running_mean, bn.running_var, int(bn.num_batches_tracked)


def devices(n: int) -> list[str]:
    return ["cpu"] * n


def grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("batch", [12, 7, 2])
def test_cnn_outputs_and_gradients_match_one_device(n: int, batch: int) -> None:
    torch.manual_seed(0)
    net = Net(1, 8, 10)
    ref = copy.deepcopy(net)
    x, y = torch.randn(batch, 1, 8, 8), torch.randint(0, 10, (batch,))
    model = dp.DataParallel(net, devices(n))
    out = model(x)
    expected = ref(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(expected, y).backward()
    for got, want in zip(grads(net), grads(ref), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert model.last_call is not None
    assert sum(model.last_call.chunk_sizes) == batch
    assert len(model.last_call.chunk_sizes) == min(n, batch)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("batch", [6, 7, 2])  # even, uneven, smaller than the device count
def test_dict_dataclass_strings_and_scalar_loss(n: int, batch: int) -> None:
    torch.manual_seed(1)
    net = DictModel()
    ref = copy.deepcopy(net)
    x, y = torch.randn(batch, 6), torch.randint(0, 3, (batch,))
    names = [f"n{i}" for i in range(batch)]
    out = dp.DataParallel(net, devices(n))(x, names, y)
    want = ref(x, names, y)
    torch.testing.assert_close(out["logits"], want["logits"], atol=1e-5, rtol=1e-5)
    assert isinstance(out["extra"], Extra)
    assert out["extra"].names == want["extra"].names
    torch.testing.assert_close(out["extra"].embedding, want["extra"].embedding)
    torch.testing.assert_close(out["loss"], want["loss"], atol=1e-6, rtol=1e-6)
    assert out["num_classes"] == 10 and type(out["num_classes"]) is int
    out["loss"].backward()
    want["loss"].backward()
    for got, exp in zip(grads(net), grads(ref), strict=True):
        torch.testing.assert_close(got, exp, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("batch", [9, 6])  # BatchNorm trains on chunks of 2 or more
def test_mlp_with_batchnorm_matches_one_device(n: int, batch: int) -> None:
    torch.manual_seed(2)
    net = mlp_bn()
    ref = copy.deepcopy(net)
    model = dp.DataParallel(net, devices(n))
    x, y = torch.randn(batch, 6), torch.randint(0, 3, (batch,))
    # training mode: BatchNorm normalises each replica's chunk, so the oracle is the same module
    # on one device applied chunk by chunk (torch.nn.DataParallel's semantics too)
    sizes = dp.plan((x,), None, devices(n)).chunk_sizes
    out = model(x)
    want = torch.cat([ref(c) for c in torch.split(x, sizes)])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(want, y).backward()
    for got, exp in zip(grads(net), grads(ref), strict=True):
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
    # eval mode: running statistics, so outputs and gradients equal the whole-batch run (the
    # oracle updated its statistics from every chunk, ours from replica 0's: copy them over)
    ref.load_state_dict(net.state_dict())
    net.eval()
    ref.eval()
    net.zero_grad()
    ref.zero_grad()
    out, want = model(x), ref(x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(want, y).backward()
    for got, exp in zip(grads(net), grads(ref), strict=True):
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_sgd_steps_match_single_device_training(n: int) -> None:
    torch.manual_seed(3)
    net = Net(1, 8, 10)
    ref = copy.deepcopy(net)
    model = dp.DataParallel(net, devices(n))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for batch in (16, 16, 11, 1):
        x, y = torch.randn(batch, 1, 8, 8), torch.randint(0, 10, (batch,))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    for p_dp, p_ref in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p_dp, p_ref, atol=1e-5, rtol=1e-5)


def test_batchnorm_running_stats_come_from_replica_zero() -> None:
    torch.manual_seed(4)
    net = mlp_bn()
    ref = copy.deepcopy(net)
    x = torch.randn(10, 6)
    dp.DataParallel(net, devices(2))(x)
    ref(x[:5])  # replica 0's chunk
    mean, var, count = bn_stats(net)
    ref_mean, ref_var, _ = bn_stats(ref)
    torch.testing.assert_close(mean, ref_mean)
    torch.testing.assert_close(var, ref_var)
    assert count == 1


def test_cached_replicas_stay_true_to_the_module() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.drop = nn.Dropout(0.5)
            self.scale = 1.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(self.fc(x)) * self.scale

    torch.manual_seed(5)
    net = Scaled()
    model = dp.DataParallel(net, devices(3))
    x = torch.randn(9, 4)
    model(x)
    net.eval()  # dropout off: deterministic
    torch.testing.assert_close(model(x), net(x))
    net.scale = 3.0
    torch.testing.assert_close(model(x), net(x))
    with torch.no_grad():
        net.fc.weight.add_(1.0)
        torch.testing.assert_close(model(x), net(x))
    torch.testing.assert_close(model(x), net(x))


def test_seed_scenarios_end_to_end() -> None:
    class TwoInputs(nn.Module):
        def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x1, x2

    # S1: each replica gets its 8 arrays
    lm = ListModel()
    arrays = [np.full(3, i, dtype=np.float64) for i in range(16)]
    out = dp.DataParallel(lm, devices(2))(arrays)
    assert sorted(lm.seen) == [8, 8] and out == [3.0 * i for i in range(16)]
    # S2: outputs as on one device
    x1, x2 = torch.randn(10, 3, 16, 16), torch.randn(1, 100, 200)
    with pytest.warns(UserWarning, match=r"args\[1\] has size 1"):
        y1, y2 = dp.DataParallel(TwoInputs(), devices(2))(x1, x2)
    assert y1.shape == (10, 3, 16, 16) and y2.shape == (1, 100, 200)
    assert torch.equal(y1, x1) and torch.equal(y2, x2)
    # S3: a batch-3 shared input is broadcast, not split 2/1
    model = dp.DataParallel(TwoInputs(), devices(2))
    x2 = torch.randn(3, 100, 200)
    assert model.explain(x1, x2).entries[1].rule == "broadcast"
    with pytest.warns(UserWarning):
        _, z2 = model(x1, x2)
    assert torch.equal(z2, x2)
    # S5: chunk sizes, max_size waves and dtype
    seen: list[tuple[int, torch.dtype]] = []
    lock = threading.Lock()

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with lock:
                seen.append((x.shape[0], x.dtype))
            return x

    x = torch.randn(16, 8)
    dp.DataParallel(Probe(), devices(4))(x)
    assert sorted(s for s, _ in seen) == [4, 4, 4, 4]
    seen.clear()
    dp.DataParallel(Probe(), devices(4), chunk_sizes=[2, 6, 4, 4])(x)
    assert sorted(s for s, _ in seen) == [2, 4, 4, 6]
    seen.clear()
    out = dp.DataParallel(Probe(), devices(4), max_size=3)(x)
    assert torch.equal(out, x) and max(s for s, _ in seen) <= 3 and sum(s for s, _ in seen) == 16
    seen.clear()
    out = dp.DataParallel(Probe(), devices(4), dtype=torch.float16)(x)
    assert {d for _, d in seen} == {torch.float16} and out.dtype == torch.float16
    # S6: output_device=-1 lands on the CPU
    lin = nn.Linear(8, 2)
    res = dp.data_parallel(lin, x, devices(2), output_device=-1)
    assert res.device.type == "cpu"
    torch.testing.assert_close(res, lin(x))


def test_s4_tutorial_loop_with_only_dataparallel_replaced(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from torch.utils.data import DataLoader, Dataset

    # -- the tutorial's code (seed 004), with nn.DataParallel replaced by dp.DataParallel --
    input_size, output_size, batch_size, data_size = 5, 2, 30, 100

    class RandomDataset(Dataset):
        def __init__(self, size: int, length: int) -> None:
            self.len = length
            self.data = torch.randn(length, size)

        def __getitem__(self, index: int) -> torch.Tensor:
            return self.data[index]

        def __len__(self) -> int:
            return self.len

    rand_loader = DataLoader(
        RandomDataset(input_size, data_size), batch_size=batch_size, shuffle=True
    )

    class Model(nn.Module):
        def __init__(self, input_size: int, output_size: int) -> None:
            super().__init__()
            self.fc = nn.Linear(input_size, output_size)

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            output = self.fc(input)
            print("\tIn Model: input size", input.size(), "output size", output.size())
            return output

    model = dp.DataParallel(Model(input_size, output_size), ["cpu", "cpu", "cpu"])
    for data in rand_loader:
        output = model(data)
        print("Outside: input size", data.size(), "output_size", output.size())
    # -- end of the tutorial's code --
    lines = capsys.readouterr().out.splitlines()
    inside = [
        int(line.split("torch.Size([")[1].split(",")[0]) for line in lines if "In Model" in line
    ]
    outside = [
        int(line.split("torch.Size([")[1].split(",")[0])
        for line in lines
        if line.startswith("Outside")
    ]
    assert outside == [30, 30, 30, 10]
    assert sorted(inside[:9]) == [10] * 9
    assert sorted(inside[9:]) == [3, 3, 4]


def test_autocast_bf16_reaches_the_replicas() -> None:
    dtypes: list[torch.dtype] = []
    lock = threading.Lock()

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            with lock:
                dtypes.append(y.dtype)
            return y

    model = dp.DataParallel(Probe(), devices(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(9, 4))
    assert dtypes == [torch.bfloat16] * 3 and out.dtype == torch.bfloat16


def _foreign_thread_count() -> int:
    """Threads other than the replica pool's (the pool creates its workers on first use)."""
    return sum(1 for t in threading.enumerate() if not t.name.startswith("dataparallel-"))


def test_exceptions_name_replica_device_and_shapes() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 3:
                raise KeyError("bad chunk")
            return x

    model = dp.DataParallel(Fails(), devices(2))
    before = _foreign_thread_count()
    with pytest.raises(KeyError, match=r"replica 1 on cpu.*Tensor\[3, 2\]") as info:
        model(torch.randn(7, 2))
    assert isinstance(info.value.__cause__, KeyError)
    # the original traceback is shown: the line of the replica's forward that raised
    shown = "".join(traceback.format_exception(info.value))
    assert 'raise KeyError("bad chunk")' in shown
    x = torch.randn(8, 2)
    assert torch.equal(model(x), x)  # the pool still works
    assert _foreign_thread_count() == before


def test_module_on_the_wrong_device_is_a_clear_error() -> None:
    model = dp.DataParallel(nn.Linear(2, 2).to(torch.float64), devices(2))
    model(torch.randn(4, 2, dtype=torch.float64))
    if torch.cuda.is_available():
        pytest.skip("needs a CPU-only machine to place the module elsewhere")
    model.src_device_obj = torch.device("meta")
    with pytest.raises(RuntimeError, match=r"module: expected its parameters and buffers on meta"):
        model(torch.randn(4, 2))


def test_state_dict_interchangeable_with_torch_dataparallel() -> None:
    net = mlp_bn()
    ours = dp.DataParallel(net, devices(2))
    theirs = nn.DataParallel(copy.deepcopy(net))
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert all(k.startswith("module.") for k in ours.state_dict())
    other = mlp_bn()
    theirs2 = nn.DataParallel(other)
    theirs2.load_state_dict(ours.state_dict())
    ours2 = dp.DataParallel(mlp_bn(), devices(2))
    ours2.load_state_dict(theirs2.state_dict())
    for a, b in zip(ours2.state_dict().values(), ours.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_gather_false_and_criterion_equal_the_single_device_loss() -> None:
    torch.manual_seed(6)
    net = Net(1, 8, 10)
    ref = copy.deepcopy(net)
    model = dp.DataParallel(net, devices(3), gather=False)
    criterion = dp.DataParallelCriterion(nn.CrossEntropyLoss(), devices(3))
    x, y = torch.randn(10, 1, 8, 8), torch.randint(0, 10, (10,))
    outputs = model(x)
    assert isinstance(outputs, dp.DeviceOutputs) and outputs.chunk_sizes == [4, 3, 3]
    loss = criterion(outputs, y)
    want = F.cross_entropy(ref(x), y)
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-6)
    loss.backward()
    want.backward()
    for got, exp in zip(grads(net), grads(ref), strict=True):
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)


def test_warning_once_per_wrapper() -> None:
    class TwoInputs(nn.Module):
        def forward(self, x: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
            return x + shared

    model = dp.DataParallel(TwoInputs(), devices(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.randn(4, 2), torch.randn(1, 2))
    assert len(caught) == 1


def test_overridden_scatter_in_torch_style_still_works() -> None:
    class MyDP(dp.DataParallel):
        def scatter(self, inputs, kwargs, device_ids):  # type: ignore[no-untyped-def]
            return dp.scatter_kwargs(inputs, kwargs, device_ids, chunk_sizes=[1, 3])

    torch.manual_seed(7)
    lin = nn.Linear(2, 2)
    model = MyDP(lin, devices(2))
    x = torch.randn(4, 2)
    out = model(x)
    # gather inferred the [1, 3] chunks: values and batch order as on one device
    torch.testing.assert_close(out, lin(x), atol=1e-6, rtol=1e-6)


def test_last_call_reports_the_chunks_an_overridden_scatter_chose() -> None:
    class MyDP(dp.DataParallel):
        def scatter(self, inputs, kwargs, device_ids):  # type: ignore[no-untyped-def]
            return dp.scatter_kwargs(inputs, kwargs, device_ids, chunk_sizes=[1, 3])

    model = MyDP(nn.Linear(2, 2), devices(2))
    model(torch.randn(4, 2))
    # the load figures show what each replica really got, not the plan's even [2, 2]
    assert model.last_call is not None and model.last_call.chunk_sizes == [1, 3]


def test_bad_options_fail_at_construction() -> None:
    with pytest.raises(ValueError, match=r"chunk_sizes: expected one size per device \(2\)"):
        dp.DataParallel(nn.Identity(), devices(2), chunk_sizes=[1, 1, 1])
    with pytest.raises(ValueError, match=r"scalars: expected one of"):
        dp.DataParallel(nn.Identity(), devices(2), scalars="max")
    with pytest.raises(ValueError, match=r"device_ids\[1\]: expected a device"):
        dp.DataParallel(nn.Identity(), ["cpu", "tpu"])


def test_mlp_with_batchnorm_in_eval_on_a_batch_smaller_than_the_device_count() -> None:
    # eval mode: running statistics, so chunks of one sample are fine and the oracle is the
    # whole batch on one device
    torch.manual_seed(8)
    net = mlp_bn()
    net(torch.randn(20, 6))  # running statistics away from their initial values
    net.eval()
    ref = copy.deepcopy(net)
    model = dp.DataParallel(net, devices(3))
    x, y = torch.randn(2, 6), torch.randint(0, 3, (2,))
    out, want = model(x), ref(x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert model.last_call is not None and model.last_call.chunk_sizes == [1, 1]
    F.cross_entropy(out, y).backward()
    F.cross_entropy(want, y).backward()
    for got, exp in zip(grads(net), grads(ref), strict=True):
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)


def test_last_call_shows_the_load_of_each_replica() -> None:
    model = dp.DataParallel(nn.Linear(3, 2), devices(3), max_size=2)
    assert model.last_call is None
    model(torch.randn(10, 3))
    stats = model.last_call
    assert stats is not None
    # 10 samples, at most 2 per replica: the fewest waves (2), each as even as possible
    assert stats.chunk_sizes == [2, 2, 1, 2, 2, 1] and stats.waves == 2
    assert stats.devices == ["cpu"] * 6
    assert len(stats.seconds) == 6 and all(s >= 0 for s in stats.seconds)
    lines = str(stats).splitlines()
    assert lines[0].split() == ["replica", "device", "samples", "ms", "samples/s"]
    assert [line.split()[2] for line in lines[1:7]] == ["2", "2", "1", "2", "2", "1"]
    assert lines[-1] == "(2 waves)"


def test_seed_scenarios_through_data_parallel() -> None:
    """S1 to S5 through the functional form, each against the same module on one device."""

    class TwoInputs(nn.Module):
        """Uses the whole of ``x2`` in the first output: a cut ``x2`` would change it."""

        def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x1 * 2 + x2.mean(), x2 + 1

    # S1: each replica gets its 8 arrays
    lm = ListModel()
    arrays = [np.arange(3, dtype=np.float64) * i for i in range(16)]
    out = dp.data_parallel(lm, arrays, devices(2))
    assert sorted(lm.seen) == [8, 8]
    assert out == ListModel()(arrays)
    # S2: outputs as on one device
    x1, x2 = torch.randn(10, 3, 16, 16), torch.randn(1, 100, 200)
    with pytest.warns(UserWarning, match=r"args\[1\] has size 1"):
        y1, y2 = dp.data_parallel(TwoInputs(), (x1, x2), devices(2))
    w1, w2 = TwoInputs()(x1, x2)
    assert y1.shape == (10, 3, 16, 16) and y2.shape == (1, 100, 200)
    torch.testing.assert_close(y1, w1)
    torch.testing.assert_close(y2, w2)
    # S3: a batch-3 shared input is broadcast whole (not split 2/1), nothing lost
    x2 = torch.randn(3, 100, 200)
    p = dp.plan((x1, x2), None, devices(2))
    assert p.entries[1].rule == "broadcast" and "not the batch size 10" in p.entries[1].why
    with pytest.warns(UserWarning, match=r"args\[1\] has size 3"):
        z1, z2 = dp.data_parallel(TwoInputs(), (x1, x2), devices(2))
    w1, w2 = TwoInputs()(x1, x2)
    torch.testing.assert_close(z1, w1)
    torch.testing.assert_close(z2, w2)
    # S4: the tutorial's sizes, observed inside the module, 10/10/10 then 4/3/3
    torch.manual_seed(9)
    inside: list[int] = []
    lock = threading.Lock()

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(5, 2)

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            with lock:
                inside.append(input.shape[0])
            return self.fc(input)

    model = Model()
    outside = []
    for data in torch.split(torch.randn(100, 5), 30):
        inside.clear()
        output = dp.data_parallel(model, data, devices(3))
        torch.testing.assert_close(output, model.fc(data), atol=1e-6, rtol=1e-6)
        outside.append((output.shape[0], sorted(inside)))
    assert outside == [(30, [10, 10, 10])] * 3 + [(10, [3, 3, 4])]
    # S5: 4 chunks of 4, chunk_sizes, max_size and dtype through **opts
    seen: list[tuple[int, torch.dtype]] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with lock:
                seen.append((x.shape[0], x.dtype))
            return x * 2

    x = torch.randn(16, 8)
    cases: list[tuple[dict[str, Any], list[int]]] = [
        ({}, [4, 4, 4, 4]),
        ({"chunk_sizes": [2, 6, 4, 4]}, [2, 4, 4, 6]),
        ({"max_size": 3}, [2] * 8),  # two waves of 2/2/2/2
    ]
    for opts, sizes in cases:
        seen.clear()
        out = dp.data_parallel(Probe(), x, devices(4), **opts)
        assert sorted(s for s, _ in seen) == sizes, opts
        assert torch.equal(out, Probe()(x)), opts  # values and batch order
    seen.clear()
    out = dp.data_parallel(Probe(), x, devices(4), dtype=torch.float16)
    assert {d for _, d in seen} == {torch.float16}
    assert out.dtype == torch.float16 and torch.equal(out, Probe()(x.half()))


def test_shared_inside_a_per_sample_list_is_not_cast_by_dtype() -> None:
    received: list[tuple[torch.dtype, torch.dtype]] = []
    lock = threading.Lock()

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor, items: list[dict[str, Any]]) -> torch.Tensor:
            with lock:
                received.extend((item["x"].dtype, item["w"].dtype) for item in items)
            return x

    weight = torch.randn(5)
    items = [{"x": torch.randn(2), "w": dp.Shared(weight)} for _ in range(4)]
    out = dp.DataParallel(Probe(), devices(2), dtype=torch.float16)(torch.randn(4, 3), items)
    assert out.dtype == torch.float16
    # the per-sample tensor is cast, the dp.Shared one is unwrapped and keeps float32
    assert received == [(torch.float16, torch.float32)] * 4


def test_criterion_with_sum_reduction_gives_the_single_device_sum() -> None:
    torch.manual_seed(10)
    net = nn.Linear(4, 3)
    ref = copy.deepcopy(net)
    model = dp.DataParallel(net, devices(3), gather=False)
    criterion = dp.DataParallelCriterion(nn.CrossEntropyLoss(reduction="sum"), devices(3))
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    loss = criterion(model(x), y)
    want = F.cross_entropy(ref(x), y, reduction="sum")
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    loss.backward()
    want.backward()
    for got, exp in zip(grads(net), grads(ref), strict=True):
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)


# -- CUDA: skipped without a GPU (tests/conftest.py) --------------------------------------------


def cuda_ids(which: str) -> list[int]:
    """``[0]``, ``[0, 0]`` (two replicas on one GPU) or every visible GPU."""
    if which == "one":
        return [0]
    if which == "repeated":
        return [0, 0]
    return list(range(torch.cuda.device_count()))


@pytest.fixture
def no_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Full float32 precision, so chunked and whole-batch results agree to 1e-5."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.mark.cuda
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("which", ["one", "repeated", "all"])
@pytest.mark.parametrize("batch", [12, 7])
def test_cuda_cnn_outputs_and_gradients_match_one_gpu(which: str, batch: int) -> None:
    torch.manual_seed(11)
    net = Net(1, 8, 10).to("cuda:0")
    ref = copy.deepcopy(net)
    x = torch.randn(batch, 1, 8, 8, device="cuda:0")
    y = torch.randint(0, 10, (batch,), device="cuda:0")
    model = dp.DataParallel(net, cuda_ids(which))
    out, want = model(x), ref(x)
    assert out.device == torch.device("cuda", 0)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(want, y).backward()
    for got, exp in zip(grads(net), grads(ref), strict=True):
        assert got.device == torch.device("cuda", 0)
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("which", ["one", "repeated"])
def test_cuda_pinned_cpu_input_gives_the_same_outputs_and_gradients(which: str) -> None:
    torch.manual_seed(12)
    net = Net(1, 8, 10).to("cuda:0")
    ref = copy.deepcopy(net)
    model = dp.DataParallel(net, cuda_ids(which))
    host = torch.randn(10, 1, 8, 8)
    pinned = host.pin_memory().requires_grad_(True)
    assert pinned.is_pinned() and pinned.is_leaf
    plain = host.clone().requires_grad_(True)
    out_pinned, out_plain = model(pinned), model(plain)
    want = ref(host.to("cuda:0"))
    assert out_pinned.device == torch.device("cuda", 0)
    torch.testing.assert_close(out_pinned, out_plain)
    torch.testing.assert_close(out_pinned, want, atol=1e-5, rtol=1e-5)
    # gradients flow back across the non-blocking copy to the pinned host tensor
    out_pinned.sum().backward()
    out_plain.sum().backward()
    assert pinned.grad is not None and plain.grad is not None
    assert pinned.grad.device.type == "cpu"
    torch.testing.assert_close(pinned.grad, plain.grad)


@pytest.mark.cuda
def test_cuda_batchnorm_running_stats_update_on_repeated_gpu() -> None:
    torch.manual_seed(13)
    net = mlp_bn().to("cuda:0")
    ref = copy.deepcopy(net)
    x = torch.randn(10, 6, device="cuda:0")
    dp.DataParallel(net, [0, 0])(x)
    ref(x[:5])  # replica 0's chunk
    mean, var, count = bn_stats(net)
    assert mean.device == torch.device("cuda", 0) and not torch.equal(mean, torch.zeros_like(mean))
    ref_mean, ref_var, _ = bn_stats(ref)
    torch.testing.assert_close(mean, ref_mean)
    torch.testing.assert_close(var, ref_var)
    assert count == 1


@pytest.mark.cuda
@pytest.mark.parametrize("which", ["one", "repeated", "all"])
def test_cuda_output_device_minus_one_lands_on_the_cpu(which: str) -> None:
    torch.manual_seed(14)
    lin = nn.Linear(8, 2).to("cuda:0")
    x = torch.randn(16, 8, device="cuda:0")
    want = lin(x).detach().cpu()
    res = dp.data_parallel(lin, x, cuda_ids(which), output_device=-1)
    assert res.device.type == "cpu"
    torch.testing.assert_close(res, want, atol=1e-5, rtol=1e-5)
    out = dp.DataParallel(lin, cuda_ids(which), output_device=-1)(x)
    assert out.device.type == "cpu"
    out.sum().backward()  # gradients cross back from the CPU to the module's GPU
    assert lin.weight.grad is not None and lin.weight.grad.device == torch.device("cuda", 0)
