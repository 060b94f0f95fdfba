"""Weights are held once: a backend that copies them to its device reads, packs and uploads
them a part at a time, and releases the mapped GGUF's pages of each part once it is there
(backends/runner.py, backends/plan.py layout_parts, GGUFFile.release)."""
from __future__ import annotations

import functools
import subprocess
import sys
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest

from dflash_ir.artifact import FileWeights
from dflash_ir.backends import runner
from dflash_ir.backends.base import get_backend
from dflash_ir.backends.plan import LAYOUTS, PART_BYTES, layout_parts, part_bytes_packed
from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.interpreter import Interpreter
from dflash_ir.models.gguf_file import open_gguf
from dflash_ir.passes.pipeline import run_pipeline

MIB = 1 << 20
Q8_ROW = 34  # bytes of one Q8_0 block (32 weights)


def write_q8_0(path: Path, rows: int, cols: int, seed: int = 0) -> Path:
    """A GGUF holding one Q8_0 tensor `w` [rows, cols] of random codes with valid scales."""
    data = np.random.default_rng(seed).integers(0, 256, (rows, cols // 32 * Q8_ROW), dtype=np.uint8)
    data.reshape(rows, cols // 32, Q8_ROW)[:, :, :2] = np.float16(0.01).reshape(1).view(np.uint8)
    w = gguf.GGUFWriter(path, arch="test")
    w.add_tensor("w", data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def matmul_graph(rows: int, cols: int):
    b = GraphBuilder("one_matmul")
    b.output("y", b.matmul(b.input("x", DType.F32, ("T", cols)), b.weight("w", DType.Q8_0, (rows, cols))))
    return run_pipeline(b.build(), level=2)


def rss_file_bytes() -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith("RssFile")).split()[1]) << 10


def _block_bytes(layout: str) -> int:
    """Bytes of one block of the type a layout packs (a row holds whole blocks)."""
    return Q8_ROW if layout.startswith("q8_0") else DType(layout.removesuffix("_dp4").removesuffix("_cols16")).block_bytes


@pytest.mark.parametrize("shape, dtype", [((40, 4), np.uint8), ((3, 20, 2), np.uint8),  # rows x blocks
                                          ((33, 5), np.float32), ((7,), np.float32)])
@pytest.mark.parametrize("part_bytes", [1, 1000, 1 << 20])
def test_parts_packed_one_after_another_are_the_whole_pack(shape, dtype, part_bytes):
    layouts = [l for l in LAYOUTS if l != "as_stored"] if dtype == np.uint8 else []
    for layout in layouts + ["as_stored"]:
        full = (*shape[:-1], shape[-1] * _block_bytes(layout)) if layout in layouts else shape
        storage = np.random.default_rng(1).integers(0, 256, full).astype(dtype)
        pack = LAYOUTS[layout]
        parts = list(layout_parts(storage, layout, part_bytes))
        packed = [pack(part) for part in parts]
        whole = pack(storage).reshape(-1).view(np.uint8)
        assert np.concatenate([p.reshape(-1).view(np.uint8) for p in packed]).tobytes() == whole.tobytes()
        assert sum(part.nbytes for part in parts) == storage.nbytes  # every source byte in exactly one part
        assert [part_bytes_packed(part, layout) for part in parts] == [p.nbytes for p in packed]
        if layout == "as_stored":  # uploaded straight from the mapping, no copy
            assert all(np.shares_memory(p, storage) for p in packed)
        into = np.full(whole.nbytes, 0xA5, np.uint8)  # a mapped device buffer's old bytes
        offsets = np.cumsum([0] + [p.nbytes for p in packed])
        for part, start, end in zip(parts, offsets, offsets[1:]):
            pack(part, out=into[start:end])
        assert into.tobytes() == whole.tobytes()  # padding rows zeroed too


def test_release_drops_the_pages_and_the_view_still_reads(tmp_path):
    f = open_gguf(write_q8_0(tmp_path / "w.gguf", 1024, 16384))  # 17 MiB
    view = f.raw("w")
    checksum = int(view.sum(dtype=np.int64))  # every page mapped in
    mapped = rss_file_bytes()
    f.release(view)
    assert mapped - rss_file_bytes() > 0.9 * view.nbytes
    assert int(view.sum(dtype=np.int64)) == checksum  # read from the file again
    with pytest.raises(ValueError, match="not a view of this file"):
        f.release(np.zeros(8, np.uint8))


@pytest.fixture
def opencl():
    be = get_backend("opencl")
    if be.unavailable_reason():
        pytest.skip(be.unavailable_reason())
    return be


@pytest.mark.parametrize("mapped", [True, False])  # packed into the mapped buffer, or packed then uploaded
@pytest.mark.parametrize("profile", ["cpu", "gpu"])  # packed (cols16) and as stored
def test_a_weight_uploaded_in_parts_computes_what_the_interpreter_does(opencl, tmp_path, monkeypatch, profile, mapped):
    rows, cols = 40, 256  # 40 rows: two whole groups of 16 and a padded one
    monkeypatch.setenv("DFLASH_IR_PROFILE", profile)
    if not mapped:
        from dflash_ir.backends.opencl import CLDevice
        monkeypatch.delattr(CLDevice, "map_for_write")
    monkeypatch.setattr(runner, "layout_parts", functools.partial(layout_parts, part_bytes=1))  # a part per unit
    f = open_gguf(write_q8_0(tmp_path / "w.gguf", rows, cols))
    g = matmul_graph(rows, cols)
    program = opencl.load(g, opencl.compile(g, tmp_path), tmp_path, FileWeights({"model": f}))
    x = {"x": np.random.default_rng(2).standard_normal((3, cols)).astype(np.float32)}
    want = Interpreter(g, FileWeights({"model": f})).run(x).outputs["y"]
    np.testing.assert_allclose(program.run(x).outputs["y"], want, rtol=1e-5, atol=1e-5)


CHILD = """
import sys
from pathlib import Path
import numpy as np
from dflash_ir.artifact import FileWeights
from dflash_ir.backends.base import get_backend
from dflash_ir.models.gguf_file import open_gguf
sys.path.insert(0, sys.argv[3])
from test_weight_memory import matmul_graph

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) << 10

rows, cols = map(int, sys.argv[4:6])
be, out, g = get_backend("opencl"), Path(sys.argv[2]), matmul_graph(rows, cols)
entry = be.compile(g, out)  # kernels built before measuring
Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from here
before = status("VmRSS")
program = be.load(g, entry, out, FileWeights({"model": open_gguf(sys.argv[1])}))
program.run({"x": np.ones((1, cols), np.float32)})
print(status("VmHWM") - before)
"""


def test_loading_holds_one_copy_of_the_weights(opencl, tmp_path):
    """A 190 MiB weight on PoCL: the packed device copy plus parts in flight (a part and its
    packed copy per packing thread), not the mapped file's pages too (414 MiB more without
    releasing them; 765 MiB packing it whole)."""
    rows, cols = 46080, 4096
    path = write_q8_0(tmp_path / "w.gguf", rows, cols)
    weight = open_gguf(path).tensors["w"].n_bytes
    child = subprocess.run([sys.executable, "-c", CHILD, str(path), str(tmp_path), str(Path(__file__).parent),
                            str(rows), str(cols)], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    grew = int(child.stdout.split()[-1])
    in_flight = (runner.pack_workers() - 1) * 2 * PART_BYTES  # the parts the other packing threads hold
    assert grew < weight * 1.1 + 48 * MIB + in_flight, f"loading a {weight / MIB:.0f} MiB weight took {grew / MIB:.0f} MiB"


def test_parts_are_packed_on_a_thread_per_core_at_most_that_many_ahead(monkeypatch):
    """A load packs on pack_workers() threads at once (a barrier of that many packers would
    time out otherwise), hands the parts back in order, and never runs more than that many
    parts ahead of the upload (the memory bound above)."""
    workers, taken = 3, []
    monkeypatch.setattr(runner, "pack_workers", lambda: workers)
    together = threading.Barrier(workers, timeout=30)

    def pack(part):
        together.wait()
        assert int(part[0]) - len(taken) <= workers  # never more than `workers` ahead of the upload
        return part * 2

    monkeypatch.setitem(runner.LAYOUTS, "probe", pack)
    parts = ((n, np.array([n]), "probe") for n in range(4 * workers))
    for part, packed in runner._ahead(parts, lambda n, array, layout: runner.LAYOUTS[layout](array)):
        taken.append(part[0])
        assert packed.tolist() == [2 * part[0]]
    assert taken == list(range(4 * workers))


def test_packing_threads_are_the_usable_cores_at_most_eight(monkeypatch):
    for cores, threads in ((1, 1), (2, 2), (64, 8)):
        monkeypatch.setattr(runner.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert runner.pack_workers() == threads
