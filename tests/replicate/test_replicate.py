"""replicate: cached replicas that mirror the module and send gradients back to it.

Oracle pattern: every value and gradient is compared with the same computation done by the
module itself (or a deep copy of it) on one device.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from dataparallel.replicate import clear_replica_cache, fresh_replicate, replicate

CPU3 = ["cpu", "cpu", "cpu"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.bn = nn.BatchNorm1d(7)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(7, 3)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x))))) * self.scale


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _chunks(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(x.chunk(n))


def test_outputs_and_gradients_match_the_module() -> None:
    model = _net().eval()  # eval: BatchNorm uses running stats, so chunks are independent
    reference = copy.deepcopy(model)
    x = torch.randn(12, 5)
    replicas = replicate(model, CPU3)
    outs = [r(c) for r, c in zip(replicas, _chunks(x, 3), strict=True)]
    loss = sum((o**2).sum() for o in outs)
    loss.backward()  # type: ignore[union-attr]

    expected = reference(x)
    (expected**2).sum().backward()
    torch.testing.assert_close(torch.cat(outs), expected, atol=1e-6, rtol=0)
    for (name, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=name)


def test_cpu_replicas_share_parameters_and_keep_private_buffers() -> None:
    model = _net()
    r0, r1, r2 = replicate(model, CPU3)
    assert r0.fc1.weight is model.fc1.weight and r2.fc1.weight is model.fc1.weight
    assert r0.bn.running_mean is model.bn.running_mean
    assert r1.bn.running_mean is not model.bn.running_mean
    assert r2.bn.running_mean is not r1.bn.running_mean
    torch.testing.assert_close(r1.bn.running_var, model.bn.running_var)


def test_replicas_are_invisible_to_the_module() -> None:
    model = _net()
    keys = list(model.state_dict())
    replicas = replicate(model, CPU3)
    assert list(model.state_dict()) == keys
    # Replica 0 on the module's own device is the module itself (nothing to copy or re-sync);
    # the others are modules in their own right (their own parameters, listed as the module
    # lists its own; torch's replicas list none), never submodules of the module.
    assert replicas[0] is model
    names = [n for n, _ in model.named_parameters()]
    assert all([n for n, _ in r.named_parameters()] == names for r in replicas[1:])
    assert not any(r is m for r in replicas[1:] for m in model.modules())
    # A replica's state_dict has the module's keys, never the module itself.
    assert list(replicas[1].state_dict()) == keys


def test_second_call_reuses_replicas_and_fresh_replicate_does_not() -> None:
    model = _net()
    first = replicate(model, CPU3)
    second = replicate(model, CPU3)
    assert all(a is b for a, b in zip(first, second, strict=True))
    assert all(a.fc1 is b.fc1 for a, b in zip(first, second, strict=True))
    other = replicate(model, ["cpu", "cpu"])  # another device tuple, another set
    assert other[1] is not first[1]
    fresh = fresh_replicate(model, CPU3)
    assert not any(a is b for a, b in zip(first[1:], fresh[1:], strict=True))
    x = torch.randn(4, 5)
    model.eval()
    torch.testing.assert_close(fresh_replicate(model, CPU3)[2](x), model(x))


@pytest.mark.parametrize(
    "change",
    ["add submodule", "replace submodule", "replace parameter", "to float64", "add hook"],
)
def test_structural_change_rebuilds(change: str) -> None:
    model = _net().eval()
    before = replicate(model, CPU3)
    if change == "add submodule":
        model.extra = nn.Linear(2, 2)
    elif change == "replace submodule":
        model.fc2 = nn.Linear(7, 3)
    elif change == "replace parameter":
        model.fc1.weight = nn.Parameter(torch.randn(7, 5))
    elif change == "to float64":
        model.to(torch.float64)
    else:
        model.fc1.register_forward_hook(lambda m, i, o: None)
    after = replicate(model, CPU3)
    assert after[1] is not before[1]
    x = torch.randn(6, 5, dtype=next(model.parameters()).dtype)
    for r in after:
        torch.testing.assert_close(r(x), model(x))


@pytest.mark.parametrize("grad", [True, False])
def test_replicas_follow_state_changes_between_calls(grad: bool) -> None:
    model = _net()
    x = torch.randn(8, 5)
    with torch.set_grad_enabled(grad):
        replicate(model, CPU3)
        model.eval()
        model.scale = 3.0
        with torch.no_grad():
            model.fc1.weight.add_(1.0)
            model.bn.running_mean.add_(0.5)
        replicas = replicate(model, CPU3)
        assert all(not m.training for r in replicas for m in r.modules())
        assert all(r.scale == 3.0 for r in replicas)
        expected = model(x)
        for r in replicas:
            torch.testing.assert_close(r(x), expected)
        del model.scale  # a removed attribute disappears from the replicas too
        assert not any(hasattr(r, "scale") for r in replicate(model, CPU3))


class _Probe(nn.Module):
    """Records, for each call, whether the weight it used required grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return self.lin(x)


def test_parameters_on_another_device_are_copied_differentiably_then_cached() -> None:
    # The meta device stands in for a second accelerator: copies are real tensors objects.
    model = _Probe()
    replicas = replicate(model, ["cpu", "meta"])
    w_cpu, w_meta = replicas[0].lin.weight, replicas[1].lin.weight
    assert w_cpu is model.lin.weight
    assert w_meta.device.type == "meta" and w_meta.grad_fn is not None  # autograd: differentiable
    assert replicate(model, ["cpu", "meta"])[1].lin.weight is not w_meta  # re-copied each call
    with torch.no_grad():
        a = replicate(model, ["cpu", "meta"])[1].lin.weight
        b = replicate(model, ["cpu", "meta"])[1].lin.weight
        assert a.grad_fn is None and a is b  # inference: the copy is reused, refreshed in place
        model.lin.weight.add_(1.0)
        c = replicate(model, ["cpu", "meta"])[1].lin.weight
        assert c is b
        model.lin.weight = nn.Parameter(torch.zeros(3, 3))  # replaced: a rebuild
        d = replicate(model, ["cpu", "meta"])[1].lin.weight
        assert d is not c and d.shape == (3, 3)
    assert replicas[1].count.device.type == "meta"


@pytest.mark.parametrize("how", ["add_", "data", "no version bump"])
def test_inference_copies_on_another_device_follow_every_change(how: str) -> None:
    # "cpu:1" is a device of its own to replicate (copies are made) while its tensors are real
    # CPU tensors, so the values of a cross-device copy can be checked without a GPU.
    model = _Probe().eval()
    devices = [torch.device("cpu"), torch.device("cpu", 1)]
    x = torch.randn(4, 3)
    with torch.no_grad():
        first = replicate(model, devices)[1]
        assert first.lin.weight is not model.lin.weight
        if how == "add_":
            model.lin.weight.add_(1.0)
        elif how == "data":
            model.lin.weight.data.mul_(0.5)  # escapes _version
        else:  # what fused optimizers do: write the storage, _version untouched
            torch._foreach_mul_([model.lin.weight.data], 3.0)
        replica = replicate(model, devices)[1]
        torch.testing.assert_close(replica.lin.weight, model.lin.weight)
        torch.testing.assert_close(replica(x), model(x))


def test_batchnorm_statistics_come_from_replica_zero() -> None:
    model = _net().train()
    reference = copy.deepcopy(model.bn)
    a, b = torch.randn(6, 7), torch.randn(6, 7) * 3 + 2
    r0, r1 = replicate(model, ["cpu", "cpu"])
    r0.bn(a)
    r1.bn(b)
    reference(a)
    torch.testing.assert_close(model.bn.running_mean, reference.running_mean)
    torch.testing.assert_close(model.bn.running_var, reference.running_var)
    assert int(model.bn.num_batches_tracked) == 1
    assert r1.bn.running_mean is not model.bn.running_mean
    assert not torch.equal(r1.bn.running_mean, model.bn.running_mean)
    # Next call: replica 1's private copy is re-synced from the module.
    _, r1 = replicate(model, ["cpu", "cpu"])
    torch.testing.assert_close(r1.bn.running_mean, model.bn.running_mean)
    assert r1.bn.running_mean is not model.bn.running_mean


def test_reassigned_buffer_is_followed() -> None:
    model = _net()
    replicate(model, ["cpu", "cpu"])
    model.bn.running_mean = torch.full((7,), 2.0)  # same shape, new tensor
    r0, r1 = replicate(model, ["cpu", "cpu"])
    assert r0.bn.running_mean is model.bn.running_mean
    torch.testing.assert_close(r1.bn.running_mean, torch.full((7,), 2.0))


def test_repeated_and_tied_parameters() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    model = nn.Sequential(emb, head)
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 10, (6,))
    outs = [r(c) for r, c in zip(replicate(model, ["cpu", "cpu"]), idx.chunk(2), strict=True)]
    torch.cat(outs).logsumexp(-1).sum().backward()
    reference(idx).logsumexp(-1).sum().backward()
    assert emb.weight.grad is not None
    torch.testing.assert_close(emb.weight.grad, reference[0].weight.grad, atol=1e-6, rtol=0)


def test_lstm_uses_its_own_replication_hook() -> None:
    torch.manual_seed(0)
    model = nn.LSTM(4, 5, batch_first=True)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, 4)
    for _ in range(2):  # the second call goes through the cached path
        model.zero_grad()
        reference.zero_grad()
        replicas = replicate(model, ["cpu", "cpu"])
        outs = [r(c)[0] for r, c in zip(replicas, x.chunk(2), strict=True)]
        torch.cat(outs).sum().backward()
        reference(x)[0].sum().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0)
    # The replica lists the tensors its forward uses (the flat weights), as the module does.
    assert [n for n, _ in replicas[1].named_parameters()] == [
        n for n, _ in model.named_parameters()
    ]
    assert all(p is getattr(replicas[1], n) for n, p in replicas[1].named_parameters())


def test_hooks_run_in_replicas() -> None:
    model = _net().eval()
    seen: list[tuple[int, ...]] = []
    model.fc1.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    for r, c in zip(replicate(model, CPU3), _chunks(torch.randn(9, 5), 3), strict=True):
        r(c)
    assert seen == [(3, 7)] * 3


class _SelfHooked(Net):
    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []
        self.fc1.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: object, out: torch.Tensor) -> None:
        self.outputs.append(out)


@pytest.mark.parametrize("cls", [Net, _SelfHooked])
def test_module_is_freed_after_use(cls: type[Net]) -> None:
    model = cls()
    model(torch.randn(2, 5))
    replicas = replicate(model, CPU3)
    replicas[1](torch.randn(2, 5))
    ref = weakref.ref(model)
    del model, replicas
    gc.collect()
    assert ref() is None


def test_self_hooked_module_still_mirrors_state() -> None:
    model = _SelfHooked().eval()
    x = torch.randn(4, 5)
    model.scale = 2.0
    r = replicate(model, CPU3)
    torch.testing.assert_close(r[2](x), model(x))
    assert len(model.outputs) == 2  # the replica's hook is the module's bound method


def test_clear_replica_cache_forces_a_rebuild() -> None:
    model = _net()
    first = replicate(model, CPU3)
    clear_replica_cache(model)
    assert replicate(model, CPU3)[1] is not first[1]
    clear_replica_cache()
    assert replicate(model, CPU3)[1] is not first[1]


def test_bad_arguments_are_reported() -> None:
    with pytest.raises(TypeError, match=r"expected a torch\.nn\.Module"):
        replicate("not a module", CPU3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"devices\[1\]"):
        replicate(_net(), ["cpu", "gpu7"])


# -- CUDA ---------------------------------------------------------------------------------------


def _cuda_lists() -> list[list[int]]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 1
    return [[0], [0, 0], list(range(count))]


@pytest.mark.cuda
@pytest.mark.parametrize("devices", _cuda_lists(), ids=str)
def test_cuda_replicas_and_gradients(devices: list[int]) -> None:
    model = _net().eval().cuda(0)
    reference = copy.deepcopy(model)
    x = torch.randn(4 * len(devices), 5, device="cuda:0")
    for _ in range(2):
        model.zero_grad()
        reference.zero_grad()
        replicas = replicate(model, devices)
        outs = []
        for r, d, c in zip(replicas, devices, _chunks(x, len(devices)), strict=True):
            assert r.fc1.weight.device == torch.device("cuda", d)
            assert r.bn.running_mean.device == torch.device("cuda", d)
            outs.append(r(c.to(f"cuda:{d}")).to("cuda:0"))
        (torch.cat(outs) ** 2).sum().backward()
        (reference(x) ** 2).sum().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        again = replicate(model, devices)
        torch.testing.assert_close(again[-1](x.to(f"cuda:{devices[-1]}")).cpu(), model(x).cpu())
