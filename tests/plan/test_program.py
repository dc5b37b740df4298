"""``plan._program``: a plan's program holds no argument, and one program serves every call of
its signature, run against that call's own arguments."""

from __future__ import annotations

import gc
import weakref

import torch

import dataparallel as dp
from dataparallel.plan import build_plan
from dataparallel.plan._program import BroadcastCut, PerSampleCut, Rebuild, SplitCut
from dataparallel.scatter import take

CPU2 = dp.resolve_devices(["cpu", "cpu"])


def _call(seed: int) -> tuple[tuple[object, ...], dict[str, object]]:
    g = torch.Generator().manual_seed(seed)
    batch = {"x": torch.randn(4, 3, generator=g), "names": ["a", "b", "c", "d"]}
    return (batch, torch.randn(2, 5, generator=g)), {"k": dp.Shared(torch.ones(2))}


def test_the_program_is_shaped_like_the_arguments() -> None:
    args, kwargs = _call(0)
    with_warning = build_plan(args, kwargs, CPU2)
    program = with_warning.program
    assert program is not None and isinstance(program.args, Rebuild)
    batch, table = program.args.children
    assert isinstance(batch, Rebuild) and [type(c) for c in batch.children] == [
        SplitCut,
        PerSampleCut,
    ]
    assert isinstance(table, BroadcastCut) and table.moves  # a tensor of another size
    assert program.kw_keys == ["k"] and program.kw_steps[0].unwrap  # dp.Shared: its inside
    assert batch.children[1].holds_arrays is False  # names: the item types say so


def test_a_template_keeps_no_argument_and_binds_to_another_call() -> None:
    args, kwargs = _call(1)
    plan = build_plan(args, kwargs, CPU2)
    template = plan.template(lambda a, k: build_plan(a, k, CPU2))
    assert template.inputs is None and template.kwargs is None
    assert template.leaf_rules is None
    ref = weakref.ref(args[0]["x"])  # type: ignore[index]
    del args, kwargs, plan
    gc.collect()
    assert ref() is None  # the template does not keep the call's batch alive

    other_args, other_kwargs = _call(2)
    bound = template.bind(other_args, other_kwargs)
    fresh = build_plan(other_args, other_kwargs, CPU2)
    for (device, start, length), (_, s, n) in zip(bound.slices[0], fresh.slices[0], strict=True):
        (got_batch, got_table), got_kw = take(bound, start, length, device)
        (want_batch, want_table), want_kw = take(fresh, s, n, device)
        assert torch.equal(got_batch["x"], want_batch["x"])
        assert got_batch["names"] == want_batch["names"]
        assert torch.equal(got_table, want_table) and torch.equal(got_kw["k"], want_kw["k"])
    # the rows of a bound plan are made from its own call when read
    assert [e.what for e in bound.entries] == [e.what for e in fresh.entries]
    assert str(bound) == str(fresh)
