"""Launch plans checked against buffer sizes before anything runs.

A kernel indexes its buffers from its grid, its int parameters and its work-group size; a
plan that launches it on a larger grid, with other sizes, or on a buffer smaller than the
one it was built for makes it read or write past that buffer (host memory on PoCL and
lavapipe). Lowering records what each kernel was built for (plan.Contract: its work-group
size, the size expressions its int parameters take, and per grid it runs on the bytes each
buffer must hold, those of the values it was bound to); the memory plan, the packs and the
weights say what each buffer holds. The runner checks one against the other when a program
loads (every launch, with every symbol at 1) and again for the sizes of each new call
before its first launch, when its launch list is resolved: about 0.5 ms for a decode of
the 16-layer synthetic target (83 launches) and 2 ms for its verify (343), on 2 busy cores.

What it catches: a plan edited or made inconsistently (a grid, a work-group size, an int
argument or a buffer binding changed, a slot of the memory plan too small, a buffer name
no slot or resident buffer holds). What it cannot: a kernel whose contract was edited
along with its launches, or whose source or binary was changed; the manifest's digest,
pinned at load, is what stops those (dflash_ir/integrity.py).
"""
from __future__ import annotations

from typing import Mapping

from dflash_ir.errors import ArtifactError
from dflash_ir.passes.plan_memory import slot_bytes

from .plan import Launch, Plan


class PlanError(ArtifactError):
    """A launch plan whose kernels would run outside what they were built for."""


def check_plan(plan: Plan, resident: Mapping[str, int], bindings: Mapping[str, int]) -> None:
    """Raise PlanError naming the program, node, kernel and buffer of the first launch that
    does not keep its kernel inside its buffers at these symbol values. `resident`: bytes
    of the buffers that are not the memory plan's (weights, packs, weight-only results)."""
    sizes: dict = {}  # buffer name or extent -> bytes, at these symbol values
    for step in plan.steps:
        for launch in step.launches:
            _check_launch(plan, step.node, launch, resident, bindings, sizes)


def _check_launch(plan: Plan, node: int, launch: Launch, resident: Mapping[str, int],
                  bindings: Mapping[str, int], sizes: dict) -> None:
    where = f"{plan.graph}: node {node}: kernel {launch.kernel}"
    contract = plan.contracts.get(launch.kernel)
    if contract is None:
        raise PlanError(f"{where}: the plan has no contract for this kernel")
    if tuple(launch.local) != contract.local:
        raise PlanError(f"{where}: launched with work-groups of {list(launch.local)}, built for {list(contract.local)}")
    if tuple(launch.ints) != contract.ints:
        raise PlanError(f"{where}: int arguments {list(launch.ints)}, but the kernel was built for {list(contract.ints)}")
    uses = [extents for groups, extents in contract.uses if groups == tuple(launch.groups)]
    if not uses:
        raise PlanError(f"{where}: grid {list(launch.groups)} is not one the kernel was built for "
                        f"({', '.join(str(list(g)) for g, _ in contract.uses)})")
    holds = [_cached(sizes, name, lambda: _buffer_bytes(plan, where, name, resident, bindings))
             for name in launch.buffers]
    short = None
    for extents in uses:
        if len(extents) != len(holds):
            short = short or f"binds {len(holds)} buffers, the kernel takes {len(extents)}"
            continue
        try:
            need = [_cached(sizes, e, lambda: slot_bytes(e, bindings)) for e in extents]
        except KeyError as e:
            raise PlanError(f"{where}: {e.args[0]}") from None
        bad = next((i for i, (n, h) in enumerate(zip(need, holds)) if n > h), None)
        if bad is None:
            return
        short = short or (f"buffer {bad} ({launch.buffers[bad]!r}) holds {holds[bad]} bytes, the kernel accesses "
                          f"{need[bad]} at {_sizes(bindings)}")
    raise PlanError(f"{where}: {short}")


def _cached(sizes: dict, key, compute):
    if key not in sizes:
        sizes[key] = compute()
    return sizes[key]


def _buffer_bytes(plan: Plan, where: str, name: str, resident: Mapping[str, int], bindings: Mapping[str, int]) -> int:
    root = plan.aliases.get(name, name)
    if root in resident:
        return resident[root]
    slot = plan.buffers.get(root)
    if not isinstance(slot, int) or not 0 <= slot < len(plan.slots):
        raise PlanError(f"{where}: buffer {name!r} is neither in the memory plan nor a resident buffer")
    return slot_bytes(plan.slots[slot], bindings)


def _sizes(bindings: Mapping[str, int]) -> str:
    return ", ".join(f"{s}={n}" for s, n in sorted(bindings.items())) or "fixed sizes"
