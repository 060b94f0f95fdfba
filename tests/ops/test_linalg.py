import numpy as np
import pytest

from dflash_ir.ops import linalg
from dflash_ir.ops.registry import OpError, get_op
from dflash_ir.types import parse_type

F = np.float32
rng = np.random.default_rng(7)
NAN_F16_BYTES = np.array([np.nan], np.float16).view(np.uint8)


def types(name, *inputs, **attrs):
    return [str(t) for t in get_op(name).output_types([parse_type(t) for t in inputs], attrs)]


def run(name, *arrays, **attrs):
    (out,) = get_op(name).run(arrays, attrs)
    return out


def q8_0(scales, quants):
    """Q8_0 storage from per-block scales [..., nb] and int8 quants [..., nb, 32], packed by hand."""
    scales = np.asarray(scales, np.float16)
    quants = np.asarray(quants, np.int8)
    blocks = np.concatenate([scales[..., None].view(np.uint8), quants.view(np.uint8)], axis=-1)
    return blocks.reshape(*scales.shape[:-1], scales.shape[-1] * 34)


def random_q8_0(*shape):
    """(storage, exact f32 values) of a random Q8_0 tensor with logical `shape`."""
    nb = shape[-1] // 32
    scales = rng.uniform(0.001, 0.02, shape[:-1] + (nb,)).astype(np.float16)
    quants = rng.integers(-127, 128, shape[:-1] + (nb, 32)).astype(np.int8)
    values = (scales.astype(F)[..., None] * quants.astype(F)).reshape(shape)
    return q8_0(scales, quants), values


def test_dequantize_each_dtype():
    storage = q8_0([[0.5, -2.0]], [[list(range(32)), [1] * 32]])
    expected = np.concatenate([0.5 * np.arange(32), [-2.0] * 32])[None]
    np.testing.assert_array_equal(run("dequantize", storage), expected)
    np.testing.assert_array_equal(run("dequantize", np.array([0x3F80, 0xC040], np.uint16)), [1.0, -3.0])
    np.testing.assert_array_equal(run("dequantize", np.array([0.5, 2], np.float16)), [0.5, 2])
    out = run("dequantize", np.array([1.5], F))
    assert out.dtype == F and out.tolist() == [1.5]


def test_dequantize_rule():
    assert types("dequantize", "q8_0[N,64]") == ["f32[N,64]"]
    assert types("dequantize", "bf16[3,5]") == ["f32[3,5]"]
    with pytest.raises(OpError, match=r"dequantize: w q8_0\[4,33\]: last dim must be a multiple of 32"):
        types("dequantize", "q8_0[4,33]")
    with pytest.raises(OpError, match="dequantize: w must be f32/f16/bf16/q8_0/q4_0/.*/mxfp4, got i32"):
        types("dequantize", "i32[4]")


def test_embedding_gathers_rows():
    table, values = random_q8_0(10, 64)
    ids = np.array([3, 0, 3, 9], np.int32)
    np.testing.assert_array_equal(run("embedding", table, ids), values[[3, 0, 3, 9]])
    dense = rng.standard_normal((5, 3)).astype(F)
    np.testing.assert_array_equal(run("embedding", dense, np.array([4], np.int32)), dense[[4]])


def test_embedding_reads_only_the_gathered_rows():
    table, _ = random_q8_0(6, 32)
    poisoned = table.copy()
    poisoned[[0, 2, 3, 5], :2] = NAN_F16_BYTES  # block scales of the rows not looked up
    out = run("embedding", poisoned, np.array([1, 4], np.int32))
    assert np.isfinite(out).all()


@pytest.mark.parametrize("bad", [10, -1])
def test_embedding_out_of_range_id(bad):
    with pytest.raises(ValueError, match=f"embedding: token id {bad} is out of range \\[0, 10\\)"):
        run("embedding", np.zeros((10, 4), F), np.array([1, bad], np.int32))


def test_embedding_rule():
    assert types("embedding", "q8_0[V,4096]", "i32[T]") == ["f32[T,4096]"]
    with pytest.raises(OpError, match="embedding: ids must be i32"):
        types("embedding", "f32[V,8]", "f32[T]")


def _matmul_loops(x, w):
    out = np.zeros(x.shape[:-1] + (w.shape[0],))
    for index in np.ndindex(x.shape[:-1]):
        for n in range(w.shape[0]):
            out[index + (n,)] = sum(float(a) * float(b) for a, b in zip(x[index], w[n]))
    return out


def test_matmul_is_linear_layer_convention():
    x = rng.standard_normal((2, 3, 64)).astype(F)
    storage, w = random_q8_0(5, 64)
    np.testing.assert_allclose(run("matmul", x, storage), _matmul_loops(x, w), rtol=1e-5, atol=1e-5)
    w16 = rng.standard_normal((4, 64)).astype(np.float16)
    np.testing.assert_allclose(run("matmul", x[0, 0], w16), _matmul_loops(x[0, 0], w16.astype(F)), rtol=1e-5, atol=1e-5)


def test_matmul_dequantises_in_chunks(monkeypatch):
    x = rng.standard_normal((3, 64)).astype(F)
    storage, w = random_q8_0(7, 64)
    monkeypatch.setattr(linalg, "_CHUNK_ELEMENTS", 2 * 64)  # two rows at a time: 4 chunks, last one short
    want = x @ w.T  # summed in BLAS's order: the f32 contract, 1e-5 of the largest output
    np.testing.assert_allclose(run("matmul", x, storage), want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("rows", [7, 16, 40])
def test_matmul_row_does_not_depend_on_the_rows_beside_it(rows):
    """Bit for bit, at every place in the block: a verify row equals the decode of that row
    (a BLAS matrix-matrix kernel breaks this on some CPUs, see `matmul`)."""
    x = rng.standard_normal((rows, 256)).astype(F)
    storage, _ = random_q8_0(96, 256)
    together = run("matmul", x, storage)
    assert all(np.array_equal(together[i], run("matmul", x[i:i + 1], storage)[0]) for i in range(rows))
    ids = rng.integers(0, 4, (rows, 2)).astype(np.int32)
    experts, _ = random_q8_0(4, 48, 256)
    routed = run("expert_matmul", x, experts, ids)
    assert all(np.array_equal(routed[i], run("expert_matmul", x[i:i + 1], experts, ids[i:i + 1])[0])
               for i in range(rows))


def test_matmul_rule():
    assert types("matmul", "f32[T,4096]", "q8_0[248320,4096]") == ["f32[T,248320]"]
    assert types("matmul", "f32[T,k,64]", "f32[N,64]") == ["f32[T,k,N]"]
    with pytest.raises(OpError, match=r"matmul: x inner dim \(64\) != w inner dim \(32\)"):
        types("matmul", "f32[T,64]", "f32[8,32]")
    with pytest.raises(OpError, match="matmul: w must have rank 2"):
        types("matmul", "f32[T,64]", "f32[2,8,64]")


def _expert_loops(x, w, ids):
    out = np.zeros(ids.shape + (w.shape[1],))
    for t in range(ids.shape[0]):
        for s in range(ids.shape[1]):
            row = x[t] if x.ndim == 2 else x[t, s]
            out[t, s] = w[ids[t, s]] @ row
    return out


@pytest.mark.parametrize("per_slot", [False, True])
def test_expert_matmul_matches_dense_loops(per_slot):
    T, k, E, N, K = 5, 3, 8, 6, 64
    storage, w = random_q8_0(E, N, K)
    ids = rng.integers(0, E, (T, k)).astype(np.int32)
    x = rng.standard_normal((T, k, K) if per_slot else (T, K)).astype(F)
    out = run("expert_matmul", x, storage, ids)
    assert out.dtype == F and out.shape == (T, k, N)
    np.testing.assert_allclose(out, _expert_loops(x, w, ids), rtol=1e-5, atol=1e-5)


def test_expert_matmul_reads_only_selected_experts():
    ids = np.array([[1, 4], [4, 6]], np.int32)
    unselected = [0, 2, 3, 5, 7]
    dense = rng.standard_normal((8, 3, 32)).astype(F)
    dense[unselected] = np.nan
    storage, _ = random_q8_0(8, 3, 32)
    storage[unselected, :, :2] = NAN_F16_BYTES  # every block scale of those experts
    assert np.isnan(run("dequantize", storage[unselected])).all()
    x = rng.standard_normal((2, 32)).astype(F)
    for w in (dense, storage):
        assert np.isfinite(run("expert_matmul", x, w, ids)).all()


class ExpertBank:
    """A weight bank that records which experts are indexed and refuses whole-array reads."""

    def __init__(self, storage):
        self.storage, self.read = storage, []
        self.shape, self.dtype = storage.shape, storage.dtype

    def __getitem__(self, expert):
        self.read.append(int(expert))
        return self.storage[expert]

    def __array__(self, *args, **kwargs):
        raise AssertionError("the whole expert bank was read")


def test_expert_matmul_indexes_each_selected_expert_once():
    storage, w = random_q8_0(8, 3, 32)
    bank = ExpertBank(storage)
    ids = np.array([[1, 4], [4, 6], [6, 1]], np.int32)
    x = rng.standard_normal((3, 32)).astype(F)
    np.testing.assert_allclose(run("expert_matmul", x, bank, ids), _expert_loops(x, w, ids), rtol=1e-5, atol=1e-5)
    assert sorted(bank.read) == [1, 4, 6]


def test_expert_matmul_out_of_range_expert():
    with pytest.raises(ValueError, match=r"expert_matmul: expert id 8 is out of range \[0, 8\)"):
        run("expert_matmul", np.zeros((1, 4), F), np.zeros((8, 2, 4), F), np.array([[0, 8]], np.int32))


def test_expert_matmul_rule():
    assert types("expert_matmul", "f32[T,2048]", "q8_0[256,512,2048]", "i32[T,8]") == ["f32[T,8,512]"]
    assert types("expert_matmul", "f32[T,8,512]", "q8_0[256,2048,512]", "i32[T,8]") == ["f32[T,8,2048]"]
    with pytest.raises(OpError, match=r"expert_matmul: x slots \(4\) != ids slots \(8\)"):
        types("expert_matmul", "f32[T,4,512]", "f32[256,2048,512]", "i32[T,8]")
    with pytest.raises(OpError, match=r"expert_matmul: x rows \(T\) != ids rows \(S\)"):
        types("expert_matmul", "f32[T,512]", "f32[256,2048,512]", "i32[S,8]")
    with pytest.raises(OpError, match="expert_matmul: ids must be i32"):
        types("expert_matmul", "f32[T,512]", "f32[256,2048,512]", "f32[T,8]")
