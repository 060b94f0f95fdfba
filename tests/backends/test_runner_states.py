"""States, and the outputs a caller keeps, stay on the device between calls: the runner hands
back DeviceArrays, takes them back without a host round trip, and they hold what the
interpreter computes."""
import numpy as np

from dflash_ir.backends.lowering import lower
from dflash_ir.backends.runner import DeviceProgram, Resident
from dflash_ir.benchmark.kernels import gdn_case
from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.interpreter import Interpreter
from dflash_ir.program import DeviceArray


class CountingDevice:
    """A CLDevice that counts the bytes crossing the host boundary."""

    def __init__(self, inner):
        self.inner = inner
        self.memory = self.inner.memory
        self.uploaded = self.downloaded = 0

    def alloc(self, nbytes):
        return self.inner.alloc(nbytes)

    def upload(self, buf, array, offset=0):
        self.uploaded += array.nbytes
        self.inner.upload(buf, array, offset)

    def download(self, buf, array):
        self.downloaded += array.nbytes
        self.inner.download(buf, array)

    def copy(self, *args):
        self.inner.copy(*args)

    def launch(self, *args):
        self.inner.launch(*args)


def _gdn(opencl, tmp_path):
    """A 5-row gated delta rule that updates its state."""
    case = gdn_case("gdn", 5, hk=2, hv=4, dk=16, dv=16)
    graph = case.graph
    device = CountingDevice(opencl.device_for(opencl.compile(graph, tmp_path), tmp_path))  # as a load does
    return case, graph, DeviceProgram(graph, lower(graph, opencl.profile()), device, lambda w: None, Resident()), device


def test_states_come_back_as_device_arrays_and_go_in_without_host_copies(opencl, tmp_path):
    case, graph, program, device = _gdn(opencl, tmp_path)
    first = program.run(case.inputs, case.states)
    (name, state), = first.states.items()
    assert isinstance(state, DeviceArray)
    want = Interpreter(graph, lambda w: None).run(case.inputs, case.states)
    assert np.allclose(np.asarray(state), want.states[name], rtol=1e-5, atol=1e-6)
    device.uploaded = device.downloaded = 0
    second = program.run(case.inputs, first.states)
    inputs_bytes = sum(np.asarray(v).nbytes for v in case.inputs.values())
    assert device.uploaded == inputs_bytes  # the state did not go through the host
    outputs_bytes = sum(np.asarray(v).nbytes for v in second.outputs.values() if not isinstance(v, DeviceArray))
    assert device.downloaded == outputs_bytes
    again = Interpreter(graph, lambda w: None).run(case.inputs, want.states)
    assert np.allclose(np.asarray(second.states[name]), again.states[name], rtol=1e-5, atol=1e-6)


def test_kept_outputs_stay_on_the_device_and_feed_another_program(opencl, tmp_path):
    """An output named in `keep` comes back as a DeviceArray; a slice of its rows goes into a
    program on another device object with the same memory (the draft taking the target's
    features) without crossing the host."""
    case, graph, program, _ = _gdn(opencl, tmp_path)
    (name, value), = [(n, v) for n, v in graph.outputs if graph.values()[v].type.rank == 3]
    res = program.run(case.inputs, case.states, keep=[name])
    kept = res.outputs[name]
    assert isinstance(kept, DeviceArray)
    host = np.asarray(kept)
    assert np.array_equal(np.asarray(kept[1:4]), host[1:4]) and kept[1:4].shape == host[1:4].shape

    b = GraphBuilder("consumer")
    b.output("y", b.neg(b.input("x", DType.F32, ("S", *host.shape[1:]))))
    consumer = b.build()
    device = CountingDevice(opencl.device_for(opencl.compile(consumer, tmp_path), tmp_path))
    other = DeviceProgram(consumer, lower(consumer, opencl.profile()), device, lambda w: None, Resident())
    y = other.run({"x": kept[1:4]}).outputs["y"]
    assert device.uploaded == 0
    assert np.array_equal(y, -host[1:4])
