"""States, and the outputs a caller keeps, stay on the device between calls: the runner hands
back DeviceArrays, takes them back without a host round trip, and they hold what the
interpreter computes."""
import numpy as np

from dflash_ir.artifact import compile_pair, load_compiled
from dflash_ir.backends import opencl as opencl_module
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


def test_the_programs_of_one_load_share_each_kv_cache_and_never_copy_it(opencl, agreeing_pair, tmp_path,
                                                                          monkeypatch):
    """Prefill, decode, verify and commit update the target's KV caches in one buffer each, and
    the draft's inject and block its caches: a speculative generation (rounds that keep 6 of
    16 rows, so the verify wrote rows the rollback drops) copies no KV cache from one
    program's buffer to another's, and its tokens are the target's alone."""
    engine = load_compiled(compile_pair(*agreeing_pair("qwen35", 5), out=tmp_path / "art", backend="opencl",
                                        n_ctx=64), load_tokenizer=False)
    prompt = list(range(3, 15))
    alone = engine.generate(prompt_ids=prompt, max_tokens=20, speculative=False, ignore_eos=True).tokens
    copied = []
    copy = opencl_module.CLDevice.copy
    monkeypatch.setattr(opencl_module.CLDevice, "copy",
                        lambda self, src, *args: copied.append((src, args[1])) or copy(self, src, *args))
    run = engine.generate(prompt_ids=prompt, max_tokens=20, adaptive=False, ignore_eos=True)
    assert run.tokens == alone
    assert {r["accepted"] for r in run.rounds} == {5}
    caches = [[state for name, state in runner.states.items()
               if any(s.value.name == name and s.by_position for p in runner.programs.values() for s in p.graph.states)]
              for runner in (engine.target, engine.draft)]
    assert all(caches) and all(isinstance(state, DeviceArray) for states in caches for state in states)
    kv_buffers = {id(state.buffer) for states in caches for state in states}
    assert copied and not [c for c in copied if {id(c[0]), id(c[1])} & kv_buffers]


def test_a_decode_step_uploads_its_inputs_in_one_copy(opencl, tiny_pair, tmp_path, monkeypatch):
    """A decode step's token, position, pos and kv_len go up in one upload (a copy command
    costs PoCL a fixed ~45 us) into views of one buffer, which its kernels read: the greedy
    tokens still equal the interpreter's."""
    def decoded(backend: str, uploads: list) -> list[int]:
        engine = load_compiled(compile_pair(*tiny_pair("qwen35"), out=tmp_path / backend, backend=backend, n_ctx=32),
                               load_tokenizer=False)
        token = int(engine.target.prefill(list(range(3, 9))).greedy[-1])
        uploads.clear()
        tokens = []
        for _ in range(5):
            token = int(engine.target.decode(token).greedy[0])
            tokens.append(token)
        return tokens

    uploads = []
    upload = opencl_module.CLDevice.upload
    monkeypatch.setattr(opencl_module.CLDevice, "upload",
                        lambda self, buf, array, offset=0: uploads.append(array.nbytes) or upload(self, buf, array, offset))
    assert decoded("opencl", uploads) == decoded("numpy", [])
    assert len(uploads) == 5
