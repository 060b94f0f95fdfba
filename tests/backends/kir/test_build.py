"""Building kernel trees (backends/kir/build.py): C's arithmetic conversions made explicit in
the tree, Python numbers taking the other operand's type, and the errors for what C would
reject or silently change. Device-free."""
import pytest

from dflash_ir.backends.kir import BOOL, F32, I16, I32, I64, U32, K, KernelBuilder, call, cast, const, dot4_i8, \
    select, var, vsum
from dflash_ir.backends.kir import build as build_module, simplify as simplify_module
from dflash_ir.backends.kir.build import binary, free_vars
from dflash_ir.backends.kir.ir import walk

i, f, l, u, s = var("i"), var("f", F32), var("l", I64), var("u", U32), var("s", I16)


def _cast(dtype, x):
    return K("cast", dtype, (x,))


@pytest.mark.parametrize("a, b, common", [
    (i, f, F32), (f, i, F32), (i, l, I64), (l, i, I64), (i, u, U32), (u, i, U32), (u, l, I64), (s, i, I32),
    (l, f, F32)])
def test_mixed_operands_convert_as_c_does_with_the_conversion_in_the_tree(a, b, common):
    node = a + b
    assert node.dtype == common
    want = tuple(x if x.dtype == common else _cast(common, x) for x in (a, b))
    assert node == K("add", common, want)


def test_comparisons_are_bool_after_the_same_conversions():
    node = i < f
    assert node == K("lt", BOOL, (_cast(F32, i), f))
    assert (l.eq(u)).src == (l, _cast(I64, u))


def test_bools_in_arithmetic_are_ints():
    cond = i < 3
    assert (cond + i) == K("add", I32, (_cast(I32, cond), i))


@pytest.mark.parametrize("x, literal, dtype, value", [
    (l, 1, I64, 1), (u, 2, U32, 2), (f, 1, F32, 1.0), (s, 3, I16, 3), (i, 7, I32, 7)])
def test_python_numbers_take_the_other_operands_type(x, literal, dtype, value):
    for node in (x + literal, literal + x):
        (c,) = [n for n in node.src if n.op == "const"]
        assert c.dtype == dtype and c.arg == value and type(c.arg) is type(value)
        assert node.dtype == dtype and not any(n.op == "cast" for n in walk(node))


def test_a_float_literal_makes_int_arithmetic_float():
    """i + 1.5 is a float addition, as in C: the literal is not truncated to an int."""
    node = i + 1.5
    assert node == K("add", F32, (_cast(F32, i), const(1.5)))


def test_int_literals_with_bools_keep_their_value():
    """(i < 3) * 5 is 0 or 5 in C: the 5 must not become `true`."""
    node = (i < 3) * 5
    assert node.dtype == I32
    assert const(5) in node.src


def test_literals_on_a_vector_stay_scalars_of_its_lane_type():
    v = var("v", F32.vec(16))
    node = v * 2
    assert node.dtype == F32.vec(16) and node.src[1] == const(2.0)


@pytest.mark.parametrize("make", [lambda: i % 1.5, lambda: i & 1.5, lambda: i | 2.0, lambda: i ^ 0.5,
                                  lambda: f % 2, lambda: f & i, lambda: i << 1.5, lambda: i >> 2.0,
                                  lambda: f << 1, lambda: f >> i])
def test_integer_operators_refuse_floats(make):
    with pytest.raises(TypeError, match="integers"):
        make()


def test_vector_operands_of_different_widths_are_refused():
    with pytest.raises(TypeError, match="different widths"):
        var("a", F32.vec(16)) + var("b", F32.vec(8))
    with pytest.raises(TypeError, match="different widths"):
        select(var("c", BOOL.vec(4)), var("a", F32.vec(16)), 0.0)


def test_two_python_numbers_are_computed_in_python():
    with pytest.raises(TypeError, match="Python"):
        binary("add", 1, 2)


def test_a_kernel_expression_has_no_truth_value():
    """`if i < 3:` in a builder would pick a branch at build time; the tree refuses."""
    with pytest.raises(TypeError, match="truth value"):
        bool(i < 3)
    with pytest.raises(TypeError):
        i < 3 and i > 1  # noqa: B015


def test_math_intrinsics_take_floats_and_check_their_arity():
    assert call("exp", i) == K("call", F32, (_cast(F32, i),), "exp")
    assert call("fma", 2, f, i) == K("call", F32, (const(2.0), f, _cast(F32, i)), "fma")
    with pytest.raises(ValueError, match="fma"):
        call("fma", f, f)
    with pytest.raises(ValueError, match="not a math intrinsic"):
        call("tanh", f)


def test_dot4_and_vector_sums_have_scalar_types():
    assert dot4_i8(i, u, 0).dtype == I32 and dot4_i8(i, u, 0).src[1] == _cast(I32, u)
    assert vsum(var("v", F32.vec(16))).dtype == F32


def test_casts_keep_the_lane_count_and_skip_no_ops():
    v = var("v", I32.vec(16))
    assert cast(F32, v).dtype == F32.vec(16)
    assert cast(I32, i) is i


# -- the statement builder --------------------------------------------------------------
def _tiny(op="add", local=(64,), extra=None):
    kb = KernelBuilder(op, local)
    a, out = kb.buffer("a", "f32"), kb.buffer("out", "f32", writes=True)
    j = kb.let("j", kb.gid(0) * local[0] + kb.lid(0))
    kb.return_if(j >= var("n_N"))
    out[j] = a[j] * 2.0 if extra is None else a[j] * extra
    return kb.build(["n_N"])


def test_identical_trees_share_a_name_and_different_ones_do_not():
    assert _tiny().name == _tiny().name
    assert _tiny().name != _tiny(extra=3.0).name
    assert _tiny().name != _tiny(local=(128,)).name
    assert _tiny().name.startswith("add_")


def test_a_tree_built_again_is_not_simplified_again(monkeypatch):
    build_module._kernel.cache_clear()
    calls = []
    real = simplify_module.simplify
    monkeypatch.setattr(simplify_module, "simplify", lambda tree: calls.append(tree) or real(tree))
    first, again = _tiny(extra=5.0), _tiny(extra=5.0)
    assert again is first and len(calls) == 1
    assert _tiny(extra=-5.0).name != first.name and len(calls) == 2


def test_symbol_sizes_become_int_parameters_only_when_used():
    k = _tiny()
    assert [p.name for p in k.params] == ["a", "out", "n_N"] and k.ints == ("n_N",)
    kb = KernelBuilder("fill", (64,))
    out = kb.buffer("out", "f32", writes=True)
    out[kb.lid(0)] = 0.0
    assert kb.build(["n_N", "n_T"]).ints == ()


def test_undeclared_variables_are_refused():
    kb = KernelBuilder("bad", (64,))
    out = kb.buffer("out", "f32", writes=True)
    out[kb.lid(0)] = var("nowhere", F32)
    with pytest.raises(ValueError, match=r"\['nowhere'\]"):
        kb.build()


def test_loop_variables_and_arrays_are_declared():
    kb = KernelBuilder("ok", (64,))
    out = kb.buffer("out", "f32", writes=True)
    acc = kb.array("acc", F32, 4)
    with kb.loop("k", 0, 4) as k:
        acc[k] = cast(F32, k)
    out[kb.lid(0)] = acc[3]
    assert free_vars(kb.build().body) == set()


@pytest.mark.parametrize("make, match", [
    (lambda kb: kb.buffer("x", "f16"), "element type"),
    (lambda kb: (kb.buffer("x", "f32"), kb.buffer("x", "i32")), "twice"),
    (lambda kb: kb.array("a", F32, 4, "global"), "private or local"),
    (lambda kb: kb.wg_reduce(kb.array("a", F32, 48, "local"), 48, "sum"), "power of two"),
    (lambda kb: kb.wg_reduce(kb.array("a", F32, 64, "local"), 64, "min"), "sum or max"),
    (lambda kb: kb.loop("k", 0).__enter__(), "needs a stop or a condition"),
])
def test_builder_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make(KernelBuilder("bad", (64,)))


def test_only_variables_and_array_elements_are_assigned():
    kb = KernelBuilder("bad", (64,))
    a = kb.buffer("a", "f32")
    with pytest.raises(TypeError, match="cannot assign to a load"):
        kb.set(a[0], 1.0)


def test_else_follows_an_if():
    kb = KernelBuilder("branches", (64,))
    out = kb.buffer("out", "f32", writes=True)
    with kb.if_(kb.lid(0) < 3):
        out[0] = 1.0
    with kb.else_():
        out[1] = 2.0
    (branch,) = [n for n in kb._blocks[0] if n.op == "if"]
    assert [len(b.src) for b in branch.src[1:]] == [1, 1]
    with pytest.raises(ValueError, match="must follow an if_"):
        with kb.else_():
            pass


def test_stores_convert_to_the_view_and_loads_take_its_value_type():
    kb = KernelBuilder("views", (64,))
    q, h, out = kb.buffer("q", "u8"), kb.buffer("h", "u16", writes=True), kb.buffer("out", "f32", writes=True)
    assert q.load(0, "i8").dtype == I32 and h.load(0, "f16").dtype == F32 and q.load(0, "i8", 16).dtype == I32.vec(16)
    out[0] = q.load(0, "i8")
    h.store(0, 2, "f16")
    stores = [n for n in kb._blocks[0] if n.op == "store"]
    assert stores[0].src[1] == _cast(F32, q.load(0, "i8"))
    assert stores[1].src[1] == const(2.0) and stores[1].arg == ("h", "f16")
