"""The peer suite: torch's ``test/distributed/test_data_parallel.py``, restated on CPU lists.

Each test below names the torch test it restates. torch runs them on two GPUs; here they run on
``["cpu", "cpu"]`` (replicas sharing the module's parameters), ``["cpu", "cpu:1"]`` and
``["cpu", "cpu:1", "cpu:1"]`` (replicas with parameter copies), against the same module on one
device. Where our behaviour differs from torch's by design, the test checks ours and names the
README's "Differences from torch.nn.DataParallel" entry. torch tests about CUDA placement alone
(``test_data_parallel_model_device``) have no CPU form and are not restated.
"""

from __future__ import annotations

import copy
import gc
import io
import types
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dataparallel as dp

LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]
ids = pytest.mark.parametrize("devices", LISTS, ids=["cpu,cpu", "cpu,cpu1", "cpu,cpu1,cpu1"])


def grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]


@ids
def test_data_parallel_buffers_requiring_grad(devices: list[str]) -> None:
    class Scaled(nn.Module):
        def __init__(self, t: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("t_rg", t)
            self.register_buffer("t_not_rg", t.clone().detach())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.t_rg + self.t_not_rg

    t = torch.randn(10, dtype=torch.double, requires_grad=True)
    m = Scaled(t)
    model = dp.DataParallel(m, devices)
    x = torch.randn(len(devices) + 1, 10, dtype=torch.double)
    assert torch.autograd.gradcheck(lambda _: model(x), (m.t_rg,))


@ids
def test_data_parallel_rnn(devices: list[str]) -> None:
    class Bidirectional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(30, 16, 1, batch_first=True, bidirectional=True)

        def forward(self, x: torch.Tensor) -> Any:
            self.rnn.flatten_parameters()
            return self.rnn(x)

    def step(model: nn.Module) -> Any:
        opt = torch.optim.SGD(model.parameters(), lr=10)
        output = model(torch.ones(4, 4, 30))
        F.mse_loss(output[0], torch.zeros_like(output[0])).backward()
        opt.step()
        return output

    with torch.no_grad():
        model = Bidirectional()
        model_dp = dp.DataParallel(copy.deepcopy(model), devices)
        # no crash with grad disabled (torch's #21108); batch 2: chunks of one
        x = torch.rand(2, 4, 30)
        _, (h, c) = model_dp(x)
        _, (h1, c1) = model(x)
        torch.testing.assert_close((h, c), (h1, c1))  # ours: one device's h_n, c_n
    out, (h, c) = step(model)
    out_dp, (h_dp, c_dp) = step(model_dp)
    torch.testing.assert_close(out_dp, out, atol=1e-5, rtol=1e-5)
    assert h_dp.shape == h.shape == (2, 4, 16)
    torch.testing.assert_close((h_dp, c_dp), (h, c), atol=1e-5, rtol=1e-5)
    for p1, p2 in zip(model.parameters(), model_dp.parameters(), strict=True):
        torch.testing.assert_close(p1, p2, atol=1e-5, rtol=1e-5)


def test_data_parallel_lazy_linear() -> None:
    # torch: a RuntimeError at the first call; ours: a ValueError there, with the fix
    model = dp.DataParallel(nn.LazyLinear(10), ["cpu", "cpu"])
    with pytest.raises(ValueError, match="run one forward on the plain module first"):
        model(torch.rand(10, 10))


def test_parallel_apply() -> None:
    l1, l2 = nn.Linear(10, 5), nn.Linear(10, 5)
    i1, i2 = torch.randn(2, 10), torch.randn(2, 10)
    expected = (l1(i1), l2(i2))
    # each input is a tuple of positional arguments, or the single argument itself
    for inputs in [((i1,), (i2,)), (i1, i2)]:
        outputs = dp.parallel_apply([l1, l2], inputs, None, ["cpu", "cpu:1"])
        for out, want in zip(outputs, expected, strict=True):
            torch.testing.assert_close(out, want)


def test_parallel_apply_autocast() -> None:
    l1, l2 = nn.Linear(10, 5), nn.Linear(10, 5)
    i1, i2 = torch.randn(2, 10), torch.randn(2, 10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = (l1(i1), l2(i2))
    for inputs in [((i1,), (i2,)), (i1, i2)]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs = dp.parallel_apply([l1, l2], inputs, None, ["cpu", "cpu:1"])
        for out, want in zip(outputs, expected, strict=True):
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out, want)


def test_parallel_apply_passes_exception() -> None:
    class Raises(nn.Module):
        def forward(self, *args: Any) -> Any:
            return {}["wonderful"]

    m = Raises()
    # the same type, naming the replica and its device, with the original traceback
    with pytest.raises(KeyError, match=r"replica \d on cpu[\s\S]*wonderful"):
        dp.parallel_apply([m, m], [(), ()], None, ["cpu", "cpu"])


@ids
def test_data_parallel_multiple_input(devices: list[str]) -> None:
    class Combine(nn.Module):
        def forward(self, var1: Any, var2: Any, float1: float, var3: Any = None) -> Any:
            if var3 is None:
                return float1 * (var1 * var2)
            return float1 * (var1 * var2 + var3)

    m = Combine()
    var1 = torch.randn(5, 5, requires_grad=True)
    var2 = torch.randn(5, 5, requires_grad=True)
    var3 = torch.randn(5, 5)
    float1 = torch.randn(1).item()

    def check(out: torch.Tensor, want: torch.Tensor) -> None:
        want.sum().backward()
        g1, g2 = var1.grad.clone(), var2.grad.clone()  # type: ignore[union-attr]
        var1.grad = var2.grad = None
        out.sum().backward()
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(var1.grad, g1)
        torch.testing.assert_close(var2.grad, g2)
        var1.grad = var2.grad = None

    check(dp.data_parallel(m, (var1, var2, float1), devices), m(var1, var2, float1))
    check(dp.data_parallel(m, (var1, var2, float1), devices[::-1]), m(var1, var2, float1))
    check(dp.data_parallel(m, (var1, var2, float1), devices[:1]), m(var1, var2, float1))
    want = m(var1, var2, float1, var3=var3)
    check(dp.DataParallel(Combine(), devices)(var1, var2, float1, var3=var3), want)
    want = m(var1, var2, float1, var3=var3)
    check(dp.DataParallel(Combine(), devices[:1])(var1, var2, float1, var3=var3), want)
    for ids_ in (devices, devices[:1]):
        want = m(var1, var2, float1, var3=var3)
        out = dp.data_parallel(m, (var1, var2, float1), ids_, module_kwargs={"var3": var3})
        check(out, want)


@ids
def test_data_parallel_small_back(devices: list[str]) -> None:
    lin = nn.Linear(10, 5)
    x = torch.randn(20, 10)
    torch.testing.assert_close(dp.data_parallel(lin, x, devices), lin(x))


@ids
def test_data_parallel_model_no_refcycles(devices: list[str]) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x)

    # torch's own test asserts ``gc.collect() == 0``; other threads of the process (a pool's,
    # a store's heartbeat left by an earlier file on this worker) may leave garbage of their
    # own meanwhile, so the cycles are looked at and only those of the call are counted.
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        model = dp.DataParallel(Model(), devices)
        model(torch.randn(len(devices), 1))
        gc.collect()
        ours = [o for o in gc.garbage if _of_the_call(o)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert ours == []


def _of_the_call(obj: object) -> bool:
    """An object that a reference cycle made by torch or this library would hold."""
    if isinstance(obj, (torch.Tensor, nn.Module)):
        return True
    if isinstance(obj, types.FrameType):
        obj = obj.f_code
    if isinstance(obj, types.CodeType):
        return "dataparallel" in obj.co_filename or "torch" in obj.co_filename
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return isinstance(module, str) and module.split(".")[0] in ("dataparallel", "torch")


@ids
def test_data_parallel_no_grad(devices: list[str]) -> None:
    seen: list[bool] = []

    class Layer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.is_grad_enabled())
            return x

    x = torch.randn(20, 10)
    with torch.no_grad():
        dp.data_parallel(Layer(), x, devices)
    assert seen == [False] * len(devices)
    seen.clear()
    dp.data_parallel(Layer(), x, devices)
    assert seen == [True] * len(devices)


# Sparse gradients through parameter copies (cpu:1): the copy is a clone, whose backward
# passes the Embedding's sparse gradient on as it is.
@pytest.mark.parametrize("devices", LISTS, ids=["cpu,cpu", "cpu,cpu1", "cpu,cpu1,cpu1"])
def test_data_parallel_sparse(devices: list[str]) -> None:
    check_data_parallel(devices, sparse=True)


@ids
def test_data_parallel(devices: list[str]) -> None:
    check_data_parallel(devices, sparse=False)


def check_data_parallel(devices: list[str], sparse: bool) -> None:
    # torch's test_data_parallel (a Linear) and test_data_parallel_sparse (an Embedding with
    # sparse gradients), each device order, and device_ids=None
    if sparse:
        m: nn.Module = nn.Embedding(10, 5, sparse=True)
        x = torch.randint(10, (20, 5))
    else:
        m, x = nn.Linear(10, 5), torch.randn(20, 10)
    want = m(x)
    want.sum().backward()
    expected = grads(m)
    for order in (devices, devices[::-1]):
        m.zero_grad()
        out = dp.data_parallel(m, x, order)
        out.sum().backward()
        assert out.device.type == "cpu"
        torch.testing.assert_close(out, want)
        for got, exp in zip(grads(m), expected, strict=True):
            if sparse:
                got, exp = got.coalesce().to_dense(), exp.coalesce().to_dense()
            torch.testing.assert_close(got, exp)
    if torch.cuda.is_available():  # None: every CUDA device, and the module is on the CPU
        with pytest.raises(RuntimeError, match=r"move it first with model\.module\.to"):
            dp.data_parallel(m, x)
    else:  # None: the CPU
        torch.testing.assert_close(dp.data_parallel(m, x), want)


@ids
def test_data_parallel_nested_output(devices: list[str]) -> None:
    def fn(x: torch.Tensor) -> Any:
        return [x, (x.sin(), x.cos(), [x.add(1)]), x, OrderedDict(a=x, b=[x.sin()])]

    class Net(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return fn(x)

    x = torch.randn(len(devices) + 1, 2)
    out = dp.data_parallel(Net(), x, devices)
    want = fn(x)
    torch.testing.assert_close(out, want)
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][2], list)
    assert type(out[3]) is OrderedDict and list(out[3]) == ["a", "b"]  # torch: a plain dict
    assert isinstance(out[3]["b"], list) and isinstance(out[3]["b"][0], torch.Tensor)


@ids
def test_data_parallel_nested_input(devices: list[str]) -> None:
    class Net(nn.Module):
        def forward(self, *inputs: Any) -> torch.Tensor:
            return inputs[1][0]

    x = torch.randn(20, 3)
    inputs = (x.cos(), (x.sin(), x), x.sin())
    torch.testing.assert_close(dp.data_parallel(Net(), inputs, devices), x.sin())


@ids
def test_data_parallel_module_zero_inputs(devices: list[str]) -> None:
    class NoInputs(nn.Module):
        def forward(self) -> torch.Tensor:
            t = torch.eye(2, 3)
            return t + (1 - t)

    want = torch.ones(2, 3)
    m = NoInputs()
    torch.testing.assert_close(dp.DataParallel(m, devices[:1])(), want)
    torch.testing.assert_close(dp.DataParallel(m, devices)(), want)
    torch.testing.assert_close(dp.data_parallel(m, None, devices[:1]), want)
    torch.testing.assert_close(dp.data_parallel(m, (), devices), want)


@ids
def test_data_parallel_device_args(devices: list[str]) -> None:
    lin = nn.Linear(10, 5)
    x = torch.randn(20, 10, requires_grad=True)
    out = dp.data_parallel(lin, x, device_ids=devices, output_device=torch.device("cpu"))
    torch.testing.assert_close(out, lin(x))
    as_devices = [torch.device(d) for d in devices]
    out = dp.data_parallel(lin, x, device_ids=as_devices, output_device=as_devices[0])
    torch.testing.assert_close(out, lin(x))


@ids
def test_data_parallel_function_deletion(devices: list[str]) -> None:
    # torch's #16532: a gradient penalty (double backward) through the wrapper
    net = nn.Linear(4, 1)
    model = dp.DataParallel(net, devices)
    x = torch.ones(len(devices), 4, requires_grad=True)
    model.zero_grad()
    out = model(x)
    (g,) = torch.autograd.grad(out, x, torch.ones_like(out), create_graph=True)
    g.mean().backward()
    assert net.weight.grad is not None
    torch.testing.assert_close(net.weight.grad, torch.full((1, 4), 0.25))
    # torch gives the bias a zero gradient (its broadcast joins the graph); one device, and
    # ours, none: the penalty does not depend on the bias
    ref = copy.deepcopy(net)
    ref.zero_grad()
    out = ref(x)
    (g,) = torch.autograd.grad(out, x, torch.ones_like(out), create_graph=True)
    g.mean().backward()
    assert net.bias.grad is None and ref.bias.grad is None


def test_scatter() -> None:
    x = torch.randn(4, 4, dtype=torch.double, requires_grad=True)
    result = dp.scatter(x, ["cpu", "cpu:1"])
    assert len(result) == 2
    torch.testing.assert_close(result[0], x[:2])
    torch.testing.assert_close(result[1], x[2:])
    grad = torch.full_like(result[0], 2)
    result[0].backward(grad)
    torch.testing.assert_close(x.grad[:2], grad)  # type: ignore[index]
    torch.testing.assert_close(x.grad[2:], torch.zeros_like(grad))  # type: ignore[index]
    y = x.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: tuple(dp.scatter(t, ["cpu", "cpu"])), (y,))
    assert torch.autograd.gradgradcheck(lambda t: tuple(dp.scatter(t, ["cpu", "cpu"])), (y,))


def test_data_parallel_complex() -> None:
    # torch broadcasts complex parameters as real views and returns view_as_real(...) of shape
    # (1, 10, 2); ours returns what the module returns: a complex (1, 10)
    class Cplx(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cplx = nn.Parameter(torch.zeros(1, 10, dtype=torch.cfloat))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.cplx

    x = torch.rand(1, 10, dtype=torch.cfloat)
    for devices in LISTS:
        out = dp.DataParallel(Cplx(), devices)(x)
        assert out.dtype == torch.cfloat and out.shape == (1, 10)
        torch.testing.assert_close(out, x)
    x = torch.rand(3, 10, dtype=torch.cfloat)
    torch.testing.assert_close(dp.DataParallel(Cplx(), ["cpu", "cpu:1"])(x), x)


@pytest.mark.parametrize("target", [-1, "cpu"])
def test_gather(target: Any) -> None:
    inputs = (
        torch.randn(2, 4, dtype=torch.double, requires_grad=True),
        torch.randn(2, 4, dtype=torch.double, requires_grad=True),
    )
    result = dp.gather(inputs, target)
    assert result.shape == (4, 4) and result.device.type == "cpu"
    torch.testing.assert_close(result[:2], inputs[0])
    torch.testing.assert_close(result[2:], inputs[1])
    grad = torch.randn(4, 4, dtype=torch.double)
    result.backward(grad)
    torch.testing.assert_close(inputs[0].grad, grad[:2])
    torch.testing.assert_close(inputs[1].grad, grad[2:])
    assert torch.autograd.gradcheck(lambda a, b: dp.gather((a, b), target), inputs)
    assert torch.autograd.gradgradcheck(lambda a, b: dp.gather((a, b), target), inputs)
    # 0-dim outputs: torch stacks them into a vector; ours averages them (a loss), and
    # scalars="stack" gives torch's vector
    scalars = (
        torch.randn((), dtype=torch.double, requires_grad=True),
        torch.randn((), dtype=torch.double, requires_grad=True),
    )
    torch.testing.assert_close(dp.gather(scalars, target), (scalars[0] + scalars[1]) / 2)
    stacked = dp.gather(scalars, target, scalars="stack")
    assert stacked.shape == (2,)
    grad2 = torch.randn(2, dtype=torch.double)
    stacked.backward(grad2)
    torch.testing.assert_close(scalars[0].grad, grad2[0])
    torch.testing.assert_close(scalars[1].grad, grad2[1])
    assert torch.autograd.gradcheck(
        lambda a, b: dp.gather((a, b), target, scalars="stack"), scalars
    )


def test_gather_different_len_dicts() -> None:
    inputs = (
        {"a": torch.randn(1, 2, requires_grad=True)},
        {"b": torch.randn(1, 2, requires_grad=True), "a": torch.randn(1, 2, requires_grad=True)},
    )
    with pytest.raises(ValueError, match="replicas disagree on the keys"):
        dp.gather(inputs, "cpu")


@ids
def test_replicate(devices: list[str]) -> None:
    module = nn.Linear(10, 5)
    x = torch.randn(2, 10)
    want = module(x)
    for devs in (tuple(devices), list(devices)):
        replicas = dp.replicate(module, devs)
        assert len(replicas) == len(devices)
        for replica in replicas:
            assert all(p.device.type == "cpu" for p in replica.parameters())
            torch.testing.assert_close(replica(x), want)


@ids
def test_replicate_buffers(devices: list[str]) -> None:
    net = nn.Module()
    net.bn = nn.BatchNorm2d(10)
    for replica in dp.replicate(net, devices):
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert getattr(replica.bn, name).device.type == "cpu", name


@ids
def test_zero_grad(devices: list[str]) -> None:
    # torch warns that zero_grad in a replica's forward has no effect (its replicas are copies
    # flagged _is_replica). Ours: replica 0 is the module itself, so its zero_grad clears the
    # module's gradients as on one device; the other replicas warn as torch's do.
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.zero_grad()
            return self.fc(x)

    net = Net()
    net.fc.weight.grad = torch.ones(3, 3)
    with pytest.warns(UserWarning, match=r"Calling \.zero_grad\(\) from a module created with"):
        dp.DataParallel(net, devices)(torch.rand(4, 3))
    assert net.fc.weight.grad is None


@ids
def test_autocast(devices: list[str]) -> None:
    class Model(nn.Linear):
        def __init__(self) -> None:
            super().__init__(8, 8)

        @torch.autocast("cpu", dtype=torch.bfloat16)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)

    model = dp.DataParallel(Model(), devices)
    assert model(torch.randn(8, 8)).dtype is torch.bfloat16


@ids
def test_save_replica_module(devices: list[str]) -> None:
    module = nn.Linear(8, 8)
    buffer = io.BytesIO()
    torch.save(dp.replicate(module, devices), buffer)
    with torch.no_grad():
        torch.save(dp.replicate(module, devices), buffer)


@ids
def test_strided_grad_layout(devices: list[str]) -> None:
    class ConvNet(nn.Module):
        def __init__(self, formats: list[torch.memory_format]) -> None:
            super().__init__()
            chans = [8, 16, 32, 16, 8]
            self.convs = nn.ModuleList(
                nn.Conv2d(chans[i], chans[i + 1], 2).to(memory_format=formats[i]) for i in range(4)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for conv in self.convs:
                x = conv(x)
            return x

    last, contig = torch.channels_last, torch.contiguous_format
    x = torch.randn(len(devices) * 4, 8, 8, 8)
    target = torch.randn(len(devices) * 4, 8, 4, 4)
    for formats in ([contig] * 4, [last] * 2 + [contig] * 2, [last] * 4):
        m = ConvNet(formats)
        m_dp = dp.DataParallel(copy.deepcopy(m), devices)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt_dp = torch.optim.SGD(m_dp.parameters(), lr=0.1)
        for _ in range(2):  # the first step makes the gradients, the second reuses them
            F.mse_loss(m(x), target).backward()
            F.mse_loss(m_dp(x), target).backward()
            for fmt, a, b in zip(formats, m.convs, m_dp.module.convs, strict=True):
                assert a.weight.grad.is_contiguous(memory_format=fmt)
                assert b.weight.grad.is_contiguous(memory_format=fmt)
                for p, q in zip(a.parameters(), b.parameters(), strict=True):
                    torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)
            opt.step()
            opt_dp.step()
            opt.zero_grad()
            opt_dp.zero_grad()


@ids
@pytest.mark.parametrize("container", ["list", "dict"])
def test_parameter_list_dict_replica(devices: list[str], container: str) -> None:
    p1, p2 = nn.Parameter(torch.rand(10)), nn.Parameter(torch.rand(10))
    seen: list[tuple[bool, bool]] = []

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if container == "list":
                self.data: Any = nn.ParameterList([p1, p2])
            else:
                self.data = nn.ParameterDict({"0": p1, "1": p2})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            k0, k1 = (0, 1) if container == "list" else ("0", "1")
            torch.testing.assert_close(self.data[k0], p1)
            torch.testing.assert_close(self.data[k1], p2)
            first, second = self.data[k0], self.data[k1]
            assert first.requires_grad and second.requires_grad
            seen.append((first.grad_fn is not None, second.grad_fn is not None))
            return x

    dp.DataParallel(Holder(), devices)(torch.randn(8, 8))
    # torch's replicas all hold differentiable copies (a grad_fn); ours share the module's own
    # parameters where the replica is on its device, and copy them elsewhere ("cpu:1")
    want = [(d != "cpu", d != "cpu") for d in devices]
    assert sorted(seen) == sorted(want)


@ids
@pytest.mark.parametrize("dtype", [torch.float, torch.double, torch.bfloat16])
@pytest.mark.parametrize("how", ["positional", "kwargs", "empty-list", "empty-dict", "empty-tuple"])
def test_data_parallel_module_and_kwargs_only(
    devices: list[str], dtype: torch.dtype, how: str
) -> None:
    # torch's TestDataParallelDeviceType: test_data_parallel_module, ..._kwargs_only and
    # ..._kwargs_only_empty_list/dict/tuple (an unused empty container beside the data)
    lin = nn.Linear(10, 5).to(dtype)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = lin

        def forward(self, input: Any) -> torch.Tensor:
            return self.l(input if isinstance(input, torch.Tensor) else input["data"])

    x = torch.randn(20, 10, dtype=dtype)
    want = lin(x)
    empty = {"empty-list": [], "empty-dict": {}, "empty-tuple": ()}
    if how == "positional":
        out = dp.DataParallel(lin, devices)(x)
    elif how == "kwargs":
        out = dp.DataParallel(Net(), devices)(input=x)
    else:
        out = dp.DataParallel(Net(), devices)(input={"data": x, "unused": empty[how]})
    assert out.device.type == "cpu" and out.dtype == dtype
    tol = {torch.float: 1e-5, torch.double: 1e-10, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out, want, atol=tol, rtol=0)
