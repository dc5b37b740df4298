"""Issue 21: dp.DataParallel as a true drop-in for torch.nn.DataParallel.

isinstance and the unwrapping helpers of accelerate and transformers, RNN hidden states in
gather, empty batches, integer counts against constants, and ``output_rules``. Every case is
checked against the same module on one device (the oracle) on the three device lists.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import dataparallel as dp

LISTS = [["cpu", "cpu"], ["cpu", "cpu:1"], ["cpu", "cpu:1", "cpu:1"]]


@contextlib.contextmanager
def no_warnings() -> Iterator[None]:
    """Any warning inside fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", ".*LSTM with projections")  # torch's own, on CPU
        yield


# -- isinstance --------------------------------------------------------------------------------


def test_is_a_torch_data_parallel_and_unwraps_everywhere() -> None:
    from accelerate.utils import extract_model_from_parallel
    from transformers.modeling_utils import unwrap_model

    net = nn.Linear(3, 2)
    model = dp.DataParallel(net, ["cpu", "cpu"])
    assert isinstance(model, nn.DataParallel) and isinstance(model, nn.parallel.DataParallel)
    assert extract_model_from_parallel(model) is net
    assert unwrap_model(model) is net
    unwrapped = model.module if isinstance(model, nn.DataParallel) else model
    assert unwrapped is net
    # torch's meaning of its attributes
    assert list(model.state_dict()) == ["module.weight", "module.bias"]
    assert model.device_ids == [torch.device("cpu"), torch.device("cpu")]
    assert model.output_device == torch.device("cpu") and model.dim == 0
    # a torch checkpoint of the same module loads, and ours loads into torch's wrapper's module
    theirs = {f"module.{k}": v * 0 + 1 for k, v in net.state_dict().items()}
    model.load_state_dict(theirs)
    assert torch.equal(net.weight, torch.ones(2, 3))


def test_overrides_are_still_told_apart_from_torchs_methods() -> None:
    class Gathers(dp.DataParallel):
        def gather(self, outputs: Any, output_device: Any) -> Any:
            return list(outputs)

    class TorchScatter(dp.DataParallel):
        scatter = nn.DataParallel.scatter  # torch's own method is an override of ours

    plain = dp.DataParallel(nn.Linear(3, 2), ["cpu", "cpu"])
    assert not any(plain._steps)
    g = Gathers(nn.Linear(3, 2), ["cpu", "cpu"])
    assert g._steps == (False, False, False, True)
    out = g(torch.randn(4, 3))
    assert isinstance(out, list) and [o.shape[0] for o in out] == [2, 2]
    assert TorchScatter(nn.Linear(3, 2), ["cpu"])._steps.scatter


# -- RNN hidden states --------------------------------------------------------------------------


class Recurrent(nn.Module):
    def __init__(self, kind: str, layers: int, bidirectional: bool, proj: int = 0) -> None:
        super().__init__()
        extra = {"proj_size": proj} if proj else {}
        cls = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind]
        self.rnn = cls(5, 6, layers, batch_first=True, bidirectional=bidirectional, **extra)

    def forward(self, x: torch.Tensor) -> Any:
        return self.rnn(x)


def close(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            close(g, w)


@pytest.mark.parametrize("devices", LISTS)
@pytest.mark.parametrize(
    ("kind", "layers", "bidirectional", "proj"),
    [("lstm", 1, True, 0), ("lstm", 2, False, 0), ("gru", 1, False, 0), ("lstm", 2, True, 3)],
)
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 6])
def test_hidden_states_come_back_as_one_devices(
    devices: list[str], kind: str, layers: int, bidirectional: bool, proj: int, batch: int
) -> None:
    torch.manual_seed(batch)
    net = Recurrent(kind, layers, bidirectional, proj)
    ref = copy.deepcopy(net)
    x = torch.randn(batch, 4, 5)
    with no_warnings():
        out = dp.DataParallel(net, devices)(x)
    want = ref(x)
    close(out, want)
    sum(t.sum() for t in torch.utils._pytree.tree_leaves(out)).backward()
    sum(t.sum() for t in torch.utils._pytree.tree_leaves(want)).backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)


def test_equal_hidden_states_on_every_replica_are_still_concatenated() -> None:
    # identical chunks give identical states: the module's LSTM says they are states
    net = Recurrent("lstm", 1, True)
    x = torch.ones(4, 3, 5)
    _, (h, c) = dp.DataParallel(net, ["cpu", "cpu"])(x)
    _, (h1, c1) = net(x)
    close((h, c), (h1, c1))


class OwnRNN(nn.Module):
    """A hand-written recurrence: no nn.RNNBase tells gather what its state is."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.cells = nn.ModuleList(nn.GRUCell(5 if i == 0 else 6, 6) for i in range(layers))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hs = []
        inp = x
        for cell in self.cells:
            h = torch.zeros(x.shape[0], 6)
            outs = []
            for t in range(x.shape[1]):
                h = cell(inp[:, t], h)
                outs.append(h)
            inp = torch.stack(outs, 1)
            hs.append(h)
        return inp, torch.stack(hs)  # (layers, batch, 6)


@pytest.mark.parametrize("devices", LISTS)
def test_an_own_rnns_state_is_told_by_shape_and_by_output_rules_where_shapes_tie(
    devices: list[str],
) -> None:
    net = OwnRNN(2)
    x = torch.randn(5, 3, 5)  # uneven: dim 0 is 2 everywhere, dim 1 each chunk size
    close(dp.DataParallel(net, devices)(x), net(x))
    # an even split of chunks of 2 = layers: both readings fit; torch's (dim 0) by default,
    # output_rules says where the batch is
    x = torch.randn(2 * len(devices), 3, 5)
    model = dp.DataParallel(net, devices, output_rules={"output[1]": 1})
    close(model(x), net(x))
    plain = dp.DataParallel(net, devices)(x)
    assert plain[1].shape == (2 * len(devices), 2, 6)  # torch's reading: documented


def test_errors_name_output_rules() -> None:
    class Squeezes(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.squeeze()

    with pytest.raises(ValueError, match=r"output_rules=\{'output': dim\}"):
        dp.DataParallel(Squeezes(), ["cpu", "cpu", "cpu"])(torch.randn(4, 1))


# -- output_rules ---------------------------------------------------------------------------------


class Many(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"y": x * 2, "n": int(x.shape[0]), "k": 3, "t": x.sum(0)}


def test_output_rules_each_rule() -> None:
    x = torch.arange(12.0).reshape(6, 2)
    rules = {"output['n']": "sum", "output['k']": "same", "output['t']": "sum"}
    out = dp.DataParallel(Many(), ["cpu", "cpu"], output_rules=rules)(x)
    assert out["n"] == 6 and out["k"] == 3
    torch.testing.assert_close(out["t"], x.sum(0))
    listed = dp.DataParallel(Many(), ["cpu", "cpu"], output_rules={"output['k']": "list"})(x)
    assert listed["k"] == [3, 3]
    stacked = dp.gather([1, 2], "cpu", output_rules={"output": "stack"})
    assert torch.equal(stacked, torch.tensor([1, 2]))
    mean = dp.gather([torch.tensor(1.0), torch.tensor(4.0)], "cpu", chunk_sizes=[2, 1],
                     output_rules={"output": "mean"})  # fmt: skip
    torch.testing.assert_close(mean, torch.tensor(2.0))
    with pytest.raises(ValueError, match=r"output\['t'\]: output_rules says 'same'"):
        dp.DataParallel(Many(), ["cpu", "cpu"], output_rules={"output['t']": "same"})(x)
    with pytest.warns(UserWarning, match=r"output_rules: \['output\[0\]'\] matched no output"):
        dp.DataParallel(Many(), ["cpu", "cpu"], output_rules={"output[0]": 1})(x)
    with pytest.raises(ValueError, match=r"output_rules\['output'\]: expected an int"):
        dp.DataParallel(Many(), ["cpu"], output_rules={"output": "max"})
    with pytest.raises(ValueError, match=r"output_rules: expected keys that are output paths"):
        dp.DataParallel(Many(), ["cpu"], output_rules={"y": 0})


# -- empty batches ------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean((2, 3)))


@pytest.mark.parametrize("devices", LISTS)
def test_an_empty_batch_is_the_plain_modules_output(devices: list[str]) -> None:
    import threading

    net = Net()
    x = torch.randn(0, 3, 8, 8)
    threads: list[threading.Thread] = []
    handle = net.register_forward_pre_hook(lambda m, a: threads.append(threading.current_thread()))
    model = dp.DataParallel(net, devices)
    out = model(x)
    handle.remove()
    assert out.shape == (0, 10) and torch.equal(out, net(x))
    assert threads == [threading.current_thread()]  # replica 0, the caller's thread
    assert model.last_call is not None and model.last_call.chunk_sizes == [0]
    assert dp.data_parallel(net, x, devices).shape == (0, 10)
    assert "an empty batch: the module runs once, on cpu" in str(model.explain(x))
    # with a gather=False model and the criterion: the plain criterion's value (NaN here)
    parts = dp.DataParallel(net, devices, gather=False)(x)
    assert parts.chunk_sizes == [0]
    loss = dp.DataParallelCriterion(nn.CrossEntropyLoss(), devices)(
        parts, torch.zeros(0, dtype=torch.long)
    )
    want = nn.CrossEntropyLoss()(net(x), torch.zeros(0, dtype=torch.long))
    assert torch.isnan(loss) and torch.isnan(want)


# -- integer counts -----------------------------------------------------------------------------


class Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.num_classes = 100

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {
            "n": int(x.shape[0]),
            "positive": (x > 0).sum(),
            "correct": (self.fc(x).argmax(1) == 0).sum(),
            "num_classes": self.num_classes,
            "loss": self.fc(x).pow(2).mean(),
        }


@pytest.mark.parametrize("devices", LISTS)
@pytest.mark.parametrize("batch", [2, 3, 4, 5, 6, 7, 9])
def test_counts_are_one_devices_and_constants_kept(devices: list[str], batch: int) -> None:
    torch.manual_seed(batch)
    net = Counts()
    x = torch.randn(batch, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dp.DataParallel(net, devices)(x)
    want = net(x)
    assert out["n"] == want["n"] and type(out["n"]) is int
    assert int(out["positive"]) == int(want["positive"]) and out["positive"].dtype == torch.int64
    assert int(out["correct"]) == int(want["correct"])
    assert out["num_classes"] == 100 and type(out["num_classes"]) is int
    torch.testing.assert_close(out["loss"], want["loss"])
    sizes = dp.plan((x,), None, devices).chunk_sizes
    even = len(set(sizes)) == 1
    # the one case that cannot be told: n equal to the chunk size on an even split
    messages = [str(w.message) for w in caught]
    squeezed = [m for m in messages if "1-sample chunk" in m]
    assert [m[:12] for m in messages if m not in squeezed] == (["output['n']:"] if even else [])
    # 1-sample chunks: 0-dim outputs may be squeezed per-sample values (issue 42), one warning
    if set(sizes) == {1}:
        assert len(squeezed) == 1
        assert squeezed[0].startswith("output['positive'], output['correct'], output['loss']: ")
    else:
        assert squeezed == []


def test_a_constant_equal_to_the_chunk_size_on_an_even_split_warns_with_the_fix() -> None:
    class Const(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
            return x, 2

    x = torch.randn(4, 3)
    with pytest.warns(UserWarning, match=r"output\[1\]: every replica returned 2.*'same'"):
        _, k = dp.DataParallel(Const(), ["cpu", "cpu"])(x)
    assert k == 4  # read as a count: the warning says how to say otherwise
    with no_warnings():
        _, k = dp.DataParallel(Const(), ["cpu", "cpu"], output_rules={"output[1]": "same"})(x)
    assert k == 2
