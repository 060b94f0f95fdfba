"""The memory plan (passes/plan_memory.py): made at the end of lowering from lowering's own
views, in-place writes and temporaries, stored in the launch plan, and allocated as it is by
the runner. The plans of the generated models are checked against lifetimes worked out
independently, from what each launch's kernel reads and writes."""
import json

import pytest

from dflash_ir.backends.lowering import PROFILES, lower
from dflash_ir.backends.plan import Plan
from dflash_ir.backends.runner import DeviceProgram, Resident
from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.passes.pipeline import run_pipeline
from dflash_ir.passes.plan_memory import BIND, Liveness, memory, size_class, slot_bytes
from dflash_ir.types import parse_type


def launch_lifetimes(graph, plan):
    """Buffer (root) -> (first, last position its bytes must hold), brute force from the
    launches alone: a launch writes or reads each buffer it binds (its kernel's parameters say
    which) at its node's index; inputs and states are written before the first node (BIND);
    the caller reads outputs and state updates after the last (END); a state holds throughout;
    weights, weight-only values and packed weights are resident."""
    end = len(graph.nodes)
    root = lambda name: plan.aliases.get(name, name)
    resident = {w.value.name for w in graph.weights} | set(plan.packs)
    resident |= {root(v.name) for s in plan.steps if s.constant for v in graph.nodes[s.node].outputs}
    touched = {v.name: {BIND} for v in graph.inputs} | {s.value.name: {BIND, end} for s in graph.states}
    for step in plan.steps:
        if step.constant:
            continue
        for launch in step.launches:
            for param, name in zip(plan.kernels[launch.kernel].buffers, launch.buffers):
                touched.setdefault(root(name), set()).add(step.node)
    for name in [v for _, v in graph.outputs] + [s.update for s in graph.states if s.update]:
        touched.setdefault(root(name), set()).add(end)
    return {r: (min(p), max(p)) for r, p in touched.items() if r not in resident}


def check_plan(graph, plan):
    """The plan gives every buffer a slot of its size class, and two buffers share a slot only
    if they are never live together, and never an input or state with an output or update."""
    live = launch_lifetimes(graph, plan)
    assert set(live) <= set(plan.buffers), sorted(set(live) - set(plan.buffers))[:5]
    types = {**{n: v.type for n, v in graph.values().items()}, **{n: parse_type(t) for n, t in plan.temps.items()}}
    for name in list(plan.buffers) + list(plan.aliases):
        if plan.aliases.get(name, name) in plan.buffers:
            symbols, per_unit = size_class(types[name])
            slot = plan.slots[plan.buffers[plan.aliases.get(name, name)]]
            assert slot[0] == symbols and slot[1] >= per_unit, (name, types[name], slot)
    bound = {v.name for v in graph.inputs} | {s.value.name for s in graph.states}
    kept = {plan.aliases.get(v, v) for v in [v for _, v in graph.outputs] + [s.update for s in graph.states if s.update]}
    kept |= {s.value.name for s in graph.states}
    held: dict[int, list[str]] = {}
    for name, slot in plan.buffers.items():
        held.setdefault(slot, []).append(name)
    for names in held.values():
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                (sa, ea), (sb, eb) = live.get(a, (BIND, BIND)), live.get(b, (BIND, BIND))
                assert ea < sb or eb < sa, f"{a} {live.get(a)} and {b} {live.get(b)} share a slot"
                assert not (a in bound and b in kept or b in bound and a in kept), (a, b)
    return live


def test_a_chain_ping_pongs_between_two_slots():
    """x -> neg -> exp -> silu -> sigmoid (an output) -> y = sigmoid * dequantize(w): each
    activation takes the slot its input's input freed, but an output never an input's; the
    weight-only value is resident."""
    b = GraphBuilder("chain")
    v = b.input("x", DType.F32, ("T", 8))
    w = b.dequantize(b.weight("w", DType.F16, (8,)), name="w32")
    for op in ("neg", "exp", "silu", "sigmoid"):
        v = b.op(op, v, name=op)
    b.output("s", v)
    b.output("y", b.mul(v, w, name="y"))
    g = b.build()
    plan = lower(g)
    check_plan(g, plan)
    slot = plan.buffers
    assert "w32" not in slot and "w" not in slot
    assert slot["x"] == slot["exp"] != slot["neg"] == slot["silu"] == slot["y"]
    assert slot["sigmoid"] not in {slot["x"], slot["neg"]}  # live from node 4 to the end
    assert plan.slots == [(("T",), 32)] * 3
    assert memory(g, plan, {"T": 10}) == (6 * 320, 3 * 320, 0)


def test_views_share_their_root_and_extend_its_lifetime():
    b = GraphBuilder("views")
    x = b.input("x", DType.F32, ("T", 8))
    a = b.exp(x, name="a")
    v = b.reshape(a, shape=("T", 2, 4), name="v")
    c = b.sigmoid(b.neg(x, name="b"), name="c")
    b.output("y", b.add(b.reshape(v, shape=("T", 8), name="w"), c, name="y"))
    g = b.build()
    plan = lower(g)
    assert plan.aliases == {"v": "a", "w": "a"} and not {"v", "w"} & set(plan.buffers)
    live = check_plan(g, plan)
    assert live["a"] == (0, 5)  # read through w by node 5
    assert plan.buffers["a"] not in {plan.buffers["b"], plan.buffers["c"]}


def test_an_in_place_write_shares_its_input_and_extends_its_lifetime():
    """kv_write into an activation nobody reads again writes over it; the result, read two
    nodes later, keeps the buffer live, so `other` (same size class) may not take it."""
    b = GraphBuilder("in_place")
    c0 = b.input("c0", DType.F32, ("C", 8))
    w = b.kv_write(b.neg(c0, name="cache"), b.input("new", DType.F32, ("T", 8)), b.input("pos", DType.I32, ()),
                   name="w")
    b.output("y", b.add(w, b.exp(c0, name="other"), name="y"))
    g = b.build()
    plan = lower(g)
    assert plan.aliases == {"w": "cache"} and "w" not in plan.buffers
    assert check_plan(g, plan)["cache"] == (0, 3)
    assert Liveness(g).end == 4 and plan.buffers["cache"] != plan.buffers["other"]


def test_an_output_is_never_the_slot_of_an_input():
    """The input dies at node 0 and the output could take its slot, but the caller may pass
    that output back in, and inputs are written first."""
    b = GraphBuilder("bound")
    ids = b.input("ids", DType.F32, ("T",))
    e = b.neg(ids, name="e")
    b.output("y", b.exp(e, name="y"))
    plan = lower(b.build())
    assert plan.buffers["y"] != plan.buffers["ids"]
    live = Liveness(b.build())
    assert live.lifetimes() == {"ids": (BIND, 0), "e": (0, 1), "y": (1, 2)}


def test_liveness_decides_in_place_writes():
    b = GraphBuilder("dead")
    x = b.input("x", DType.F32, ("T", 8))
    a = b.exp(x, name="a")
    b.reshape(a, shape=("T", 2, 4), name="v")
    b.output("y", b.neg(a, name="y"))
    live = Liveness(b.build())
    live.alias("v", "a")
    assert live.dead_after("a", 2) and not live.dead_after("a", 1) and not live.dead_after("v", 1)
    assert not live.dead_after("y", 2)  # the caller reads it
    live.temp("t", 1)
    assert not live.dead_after("t", 1)  # temporaries are never written over


def test_the_memory_plan_round_trips_through_the_manifest():
    b = GraphBuilder("g")
    x = b.input("x", DType.F32, ("T", 12))
    b.output("y", b.exp(b.neg(x)))
    plan = lower(b.build())
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert (again.slots, again.buffers) == (plan.slots, plan.buffers) and plan.slots


@pytest.fixture(scope="module")
def lowered(tiny_models):
    """(arch, profile) -> {program: (graph, plan)} of the generated q8_0 pairs at -O2."""
    made = {}

    def get(arch, profile):
        if (arch, profile) not in made:
            pair = tiny_models(arch, "q8_0")
            graphs = {name: run_pipeline(g) for name, g in pair.graphs.items()}
            made[arch, profile] = {name: (g, lower(g, profile)) for name, g in graphs.items()}
        return made[arch, profile]
    return get


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_no_two_buffers_live_together_share_a_slot(lowered, arch, profile):
    for name, (g, plan) in lowered(arch, profile).items():
        live = check_plan(g, plan)
        end = len(g.nodes)
        viewed = {r for v, r in plan.aliases.items() if v not in plan.temps}
        for step in plan.steps:  # temporaries live during their step only (unless an output is a view of one)
            for t in step.temps:
                if t in plan.buffers and t not in viewed:
                    assert live.get(t, (step.node, step.node)) == (step.node, step.node), (name, t)
        for out in [v for _, v in g.outputs] + [s.update for s in g.states if s.update]:
            root = plan.aliases.get(out, out)
            if root in plan.buffers:
                assert live[root][1] == end
        if name != "target.commit":  # (whose buffers are all inputs, outputs and states)
            assert len(plan.slots) < len(plan.buffers), name  # there was reuse


class CountingDevice:
    """A device that allocates nothing real and counts what it is asked to allocate."""

    def __init__(self):
        self.allocs = []

    def alloc(self, nbytes):
        self.allocs.append(nbytes)
        return object()

    def upload(self, buf, array, offset=0):
        pass

    def download(self, buf, array):
        pass

    def launch(self, kernel, groups, local, args):
        pass


@pytest.mark.parametrize("profile", PROFILES)
def test_the_runner_allocates_exactly_the_plan_slots(tiny_models, lowered, model_call, profile):
    weights = tiny_models("qwen35moe", "q8_0").weights
    for name, (g, plan) in lowered("qwen35moe", profile).items():
        device = CountingDevice()
        program = DeviceProgram(g, plan, device, weights, Resident())
        fixed = isinstance(g.inputs[0].type.shape[0], int)
        seen = []
        for rows in (3, 5, 3):
            inputs, states = model_call(g, g.inputs[0].type.shape[0] if fixed else rows)
            loaded = len(device.allocs)
            bindings = program.run(inputs, states).bindings
            if bindings in seen:  # sizes seen before: the same buffers
                assert len(device.allocs) == loaded, name
                continue
            seen.append(bindings)
            if len(seen) == 1:
                assert device.allocs[loaded:] == [slot_bytes(s, bindings) for s in plan.slots], name
                assert sum(device.allocs[loaded:]) == memory(g, plan, bindings).allocated  # what the report prints
            else:  # new sizes: new buffers but for the slots sized by the capacity C alone (the states')
                assert device.allocs[loaded:] == [slot_bytes(s, bindings) for s in plan.slots if set(s[0]) - {"C"}]


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_the_plan_needs_less_than_a_buffer_each(lowered, arch):
    g, plan = lowered(arch, "gpu")["target.verify"]
    own, planned, states = memory(g, plan, {"T": 16, "R": 16, "C": 64})
    assert planned < own and states > 0
    g, plan = lowered(arch, "gpu")["target.prefill"]
    own, planned, _ = memory(g, plan, {"T": 64, "R": 1, "C": 64})
    assert planned < own
