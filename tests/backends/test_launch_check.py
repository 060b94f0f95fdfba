"""Device-free: every launch plan is checked against its kernels' contracts and its buffers'
sizes before anything runs (backends/launch_check.py): plans as lowered pass, at load and
at their call's sizes, in both device profiles; plans edited so a kernel would run past a
buffer are refused with the program, node, kernel and buffer named, and no kernel launched."""
from dataclasses import replace

import numpy as np
import pytest

from dflash_ir.backends.launch_check import PlanError
from dflash_ir.backends.lowering import PROFILES, lower
from dflash_ir.backends.plan import LAYOUTS, Plan, packed_bytes
from dflash_ir.backends.runner import DeviceProgram, Resident
from dflash_ir.dtypes import DType
from dflash_ir.quant import storage_shape
from dflash_ir.types import TensorType
from kernel_cases import CASES, case_graph


class RecordingDevice:
    """Allocates host byte arrays and records every launch instead of running it."""

    def __init__(self):
        self.launches = []

    def alloc(self, nbytes):
        return bytearray(nbytes)

    def upload(self, buf, array, offset=0):
        pass

    def download(self, buf, array):
        pass

    def launch(self, kernel, groups, local, args):
        self.launches.append(kernel)


def _case(name: str, profile: str = "cpu"):
    c = CASES[name].build()
    graph = case_graph(c)
    return c, graph, lower(graph, profile)


def _load(c, graph, plan: Plan, device=None):
    return DeviceProgram(graph, plan, device or RecordingDevice(), lambda w: c.weights[w.tensor], Resident())


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_lowered_plan_passes_at_load_and_at_its_sizes(name, profile):
    c, graph, plan = _case(name, profile)
    device = RecordingDevice()
    _load(c, graph, plan, device).run(c.inputs, c.states)
    assert device.launches or not any(s.launches for s in plan.steps)


def _first_launch(plan: Plan, kernel_op: str):
    """(step index, launch index) of the first launch of a kernel whose name starts with kernel_op."""
    return next((i, j) for i, s in enumerate(plan.steps) for j, l in enumerate(s.launches)
                if l.kernel.startswith(kernel_op))


def _edit_launch(plan: Plan, at, **changes) -> Plan:
    i, j = at
    step = plan.steps[i]
    launches = list(step.launches)
    launches[j] = replace(launches[j], **changes)
    steps = list(plan.steps)
    steps[i] = replace(step, launches=tuple(launches))
    return replace(plan, steps=steps)


def _refused(c, graph, plan, pattern):
    device = RecordingDevice()
    with pytest.raises(PlanError, match=pattern):
        _load(c, graph, plan, device)
    assert device.launches == [], "a kernel ran before the plan was refused"


def test_a_grid_larger_than_the_kernel_was_built_for_is_refused():
    c, graph, plan = _case("add_broadcast")
    at = _first_launch(plan, "add")
    launch = plan.steps[at[0]].launches[at[1]]
    edited = _edit_launch(plan, at, groups=(f"({launch.groups[0]}) * 100", "1", "1"))
    _refused(c, graph, edited, rf"^add_broadcast: node {plan.steps[at[0]].node}: kernel {launch.kernel}: "
                               r"grid \[.*\* 100', '1', '1'\] is not one the kernel was built for")


def test_a_work_group_size_or_int_argument_other_than_built_for_is_refused():
    c, graph, plan = _case("add_broadcast")
    at = _first_launch(plan, "add")
    _refused(c, graph, _edit_launch(plan, at, local=(512, 1, 1)),
             r"kernel add_\w+: launched with work-groups of \[512, 1, 1\], built for \[256, 1, 1\]")
    _refused(c, graph, _edit_launch(plan, at, ints=("n_T * 100",)),
             r"kernel add_\w+: int arguments \['n_T \* 100'\], but the kernel was built for \['n_T'\]")


def test_a_buffer_rebound_to_a_smaller_value_is_refused_naming_it():
    """The broadcast add's output rebound to its (3, 1) operand: 12 bytes where the kernel
    writes T x 3 x 4 floats."""
    c, graph, plan = _case("add_broadcast")
    at = _first_launch(plan, "add")
    a, b, out = plan.steps[at[0]].launches[at[1]].buffers
    _refused(c, graph, _edit_launch(plan, at, buffers=(a, b, b)),
             rf"kernel add_\w+: buffer 2 \('{b}'\) holds 12 bytes, the kernel accesses 48 at T=1")


def test_a_buffer_no_slot_or_resident_buffer_holds_is_refused():
    c, graph, plan = _case("add_broadcast")
    at = _first_launch(plan, "add")
    a, b, _ = plan.steps[at[0]].launches[at[1]].buffers
    _refused(c, graph, _edit_launch(plan, at, buffers=(a, b, "elsewhere")),
             r"buffer 'elsewhere' is neither in the memory plan nor a resident buffer")


def test_a_kernel_without_a_contract_is_refused():
    c, graph, plan = _case("add_broadcast")
    _refused(c, graph, replace(plan, contracts={}), r"kernel add_\w+: the plan has no contract for this kernel")


def test_a_slot_too_small_for_the_call_is_refused_before_its_first_launch():
    """A memory plan whose output slot no longer grows with T holds the kernel's output at
    T=1 (the load passes) but not at the call's T=5: that call is refused before it launches."""
    c, graph, plan = _case("add_broadcast")
    out = graph.outputs[0][1]
    slot = plan.buffers[plan.aliases.get(out, out)]
    symbols, per_unit = plan.slots[slot]
    assert symbols == ("T",)
    slots = list(plan.slots)
    slots[slot] = ((), per_unit)
    device = RecordingDevice()
    program = _load(c, graph, replace(plan, slots=slots), device)
    with pytest.raises(PlanError, match=rf"holds {per_unit} bytes, the kernel accesses {5 * per_unit} at T=5"):
        program.run(c.inputs, c.states)
    assert device.launches == []


@pytest.mark.parametrize("shapes", [[(16, 2)], [(20, 1)], [(3, 40, 2), (24, 2)], [(1, 1)]])  # rows x blocks
def test_packed_bytes_are_what_the_packer_makes(shapes):
    """The extents of packs are computed without packing: they must equal the packer's bytes."""
    for layout, pack in LAYOUTS.items():
        dtype = DType.Q8_0 if layout.startswith("q8_0") or layout == "as_stored" else DType(
            layout.removesuffix("_dp4").removesuffix("_cols16"))
        types = [TensorType(dtype, (*s[:-1], s[-1] * dtype.block_size)) for s in shapes]
        made = sum(pack(np.zeros(storage_shape(t.shape, t.dtype), np.uint8)).nbytes for t in types)
        assert packed_bytes(types, layout) == made, layout
