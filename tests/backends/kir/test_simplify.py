"""Algebraic simplification of kernel trees (backends/kir/simplify.py): constants folded as C
computes them (integer results only in range, f32 arithmetic and comparisons rounded as f32),
integer identities, and nothing that changes a float result; checked on hand-made trees and
on random ones evaluated before and after by a small evaluator with C's semantics. Device-free."""
import math
import random

import numpy as np
import pytest

from dflash_ir.backends.kir import BOOL, F32, I32, I64, U32, K, cast, const, maximum, minimum, select, var
from dflash_ir.backends.kir.build import binary
from dflash_ir.backends.kir.simplify import simplify

from c_semantics import Undefined, evaluate

x, y, f = var("x"), var("y"), var("f", F32)


def _value(node: K):
    assert node.op == "const", f"not folded: {node!r}"
    return node.arg


# -- constant folding -------------------------------------------------------------------
@pytest.mark.parametrize("op, a, b, want", [
    ("add", 3, 4, 7), ("sub", 3, 10, -7), ("mul", -6, 7, -42), ("div", -7, 2, -3), ("div", 7, -2, -3),
    ("mod", -7, 2, -1), ("mod", 7, -2, 1), ("shl", 3, 4, 48), ("shr", -16, 2, -4), ("and", 12, 10, 8),
    ("or", 12, 10, 14), ("xor", 12, 10, 6), ("min", -3, 2, -3), ("max", -3, 2, 2)])
def test_int_constants_fold_as_c_computes_them(op, a, b, want):
    """Division and remainder truncate toward zero (C), not toward -inf (Python)."""
    node = simplify(binary(op, const(a), const(b)))
    assert _value(node) == want and node.dtype == I32


def test_int_folding_stays_in_range():
    """A result the type cannot hold is left to the device (which wraps or traps), not
    replaced by a value the printed literal would not mean."""
    assert simplify(const(2 ** 31 - 1) + const(1)).op == "add"
    assert simplify(const(-2 ** 31) - const(1)).op == "sub"
    assert simplify(const(0, U32) - const(1, U32)).op == "sub"
    assert simplify(const(1) << const(31)).op == "shl"
    assert _value(simplify(const(2 ** 31 - 1, I64) + const(1, I64))) == 2 ** 31
    assert _value(simplify(const(2 ** 32 - 1, U32) * const(1, U32))) == 2 ** 32 - 1


def test_division_by_zero_is_not_folded():
    assert simplify(const(1) / const(0)).op == "div" and simplify(const(1) % const(0)).op == "mod"


def test_i64_division_is_exact_beyond_double_precision():
    """(2^62 + 1) / 3 and its remainder, exactly (a float division would round them)."""
    a = 2 ** 62 + 1
    assert _value(simplify(const(a, I64) / const(3, I64))) == a // 3
    assert _value(simplify(const(a, I64) % const(3, I64))) == a % 3
    assert _value(simplify(const(-a, I64) / const(3, I64))) == -(a // 3)


def test_f32_constants_fold_in_f32():
    got = _value(simplify(const(0.1) + const(0.2)))
    assert got == float(np.float32(0.1) + np.float32(0.2)) and got != 0.1 + 0.2
    assert _value(simplify(const(16777216.0) + const(1.0))) == 16777216.0  # 2^24 + 1 is not an f32
    assert _value(simplify(const(1e38) * const(10.0))) == math.inf
    assert _value(simplify(const(1.0) / const(3.0))) == float(np.float32(1) / np.float32(3))
    assert math.isnan(_value(simplify(const(0.0) / const(0.0))))


def test_f32_comparisons_fold_in_f32():
    """0.1 and the f32 nearest 0.1 differ as doubles but print as the same f32 literal."""
    near = float(np.float32(0.1))
    assert _value(simplify(const(0.1) < const(near))) is False
    assert _value(simplify(const(0.1).eq(const(near)))) is True
    assert _value(simplify(const(1.0) < const(2.0))) is True


def test_constant_casts_fold_to_the_target_type():
    assert _value(simplify(cast(F32, const(16777217)))) == 16777216.0
    assert _value(simplify(cast(I64, const(-5)))) == -5 and simplify(cast(I64, const(-5))).dtype == I64
    assert simplify(cast(I32, const(2 ** 40, I64))).op == "cast"  # out of range: left as it is
    assert simplify(cast(I32, const(2.5))).op == "cast"  # C truncates; left to the device


# -- identities ---------------------------------------------------------------------------
def test_multiplying_by_one_and_dividing_by_one():
    assert simplify(x * 1) == x and simplify(1 * x) == x and simplify(x / 1) == x
    assert simplify(f * 1.0) == f and simplify(1.0 * f) == f and simplify(f / 1.0) == f


def test_adding_zero_only_for_ints():
    """f + 0.0 is not f: -0.0 + 0.0 = +0.0."""
    assert simplify(x + 0) == x and simplify(0 + x) == x and simplify(x - 0) == x
    assert simplify(f + 0.0).op == "add" and simplify(f - 0.0).op == "sub"


def test_multiplying_by_zero_only_for_ints():
    """f * 0.0 is not 0.0: NaN, infinities and -0.0."""
    assert _value(simplify(x * 0)) == 0 and _value(simplify(0 * x)) == 0 and _value(simplify(x % 1)) == 0
    assert simplify(f * 0.0).op == "mul"


def test_int_constants_reassociate():
    assert simplify((x + 3) + 4) == x + 7
    assert simplify((x * 3) * 4) == x * 12
    assert simplify(((x + 1) + 2) * 1 + 0) == x + 3
    assert simplify((x + 3) * 4) == (x + 3) * 4  # different ops: nothing to gather
    assert simplify((x + (2 ** 31 - 1)) + 1) == (x + (2 ** 31 - 1)) + 1  # the sum is no i32
    assert simplify((f + 1.0) + 2.0) == (f + 1.0) + 2.0  # floats are not associative


def test_select_of_a_constant_condition():
    assert simplify(select(const(True), x, y)) == x and simplify(select(const(False), x, y)) == y
    assert simplify(select(const(1) < const(2), f, 2.0)) == f
    assert simplify(select(x < 2, x, y)) == select(x < 2, x, y)


def test_min_and_max_of_one_int():
    assert simplify(minimum(x, x)) == x and simplify(maximum(y, y)) == y


# -- random trees: the value never changes ------------------------------------------------
F_CONSTS = [0.0, -0.0, 1.0, -1.0, 2.0, 0.5, 3.0, 0.1, float(np.float32(0.1)), 1e30, 3e38, math.inf, -math.inf,
            math.nan, 16777216.0]
I_CONSTS = [0, 1, -1, 2, 3, 7, 1000, 2 ** 31 - 1, -2 ** 31, 65536]


def _int_tree(rng: random.Random, depth: int, dtype=I32) -> K:
    if depth == 0 or rng.random() < 0.25:
        if rng.random() < 0.5:
            return var(rng.choice(["n0", "n1", "n2"])) if dtype == I32 else cast(dtype, var(rng.choice(["n0", "n1"])))
        return const(rng.choice(I_CONSTS), dtype)
    kind = rng.random()
    if kind < 0.1:
        return select(_cmp(rng, depth - 1), _int_tree(rng, depth - 1, dtype), _int_tree(rng, depth - 1, dtype))
    if kind < 0.15:
        return -_int_tree(rng, depth - 1, dtype)
    op = rng.choice(["add", "add", "sub", "mul", "mul", "div", "mod", "min", "max"])
    return binary(op, _int_tree(rng, depth - 1, dtype), _int_tree(rng, depth - 1, dtype))


def _float_tree(rng: random.Random, depth: int) -> K:
    if depth == 0 or rng.random() < 0.25:
        r = rng.random()
        if r < 0.4:
            return var(rng.choice(["f0", "f1", "f2"]), F32)
        if r < 0.5:
            return cast(F32, _int_tree(rng, 1))
        return const(rng.choice(F_CONSTS))
    kind = rng.random()
    if kind < 0.15:
        return select(_cmp(rng, depth - 1), _float_tree(rng, depth - 1), _float_tree(rng, depth - 1))
    if kind < 0.2:
        return -_float_tree(rng, depth - 1)
    if kind < 0.3:  # (t op c1) op c2: what an integer rule would regroup
        op = rng.choice(["add", "mul"])
        inner = binary(op, _float_tree(rng, depth - 1), const(rng.choice(F_CONSTS + [0.2, 0.3, 1e-8])))
        return binary(op, inner, const(rng.choice(F_CONSTS + [0.2, 0.3, 1e-8])))
    op = rng.choice(["add", "sub", "mul", "div", "min", "max"])
    return binary(op, _float_tree(rng, depth - 1), _float_tree(rng, depth - 1))


def _cmp(rng: random.Random, depth: int) -> K:
    op = rng.choice(["lt", "le", "gt", "ge", "eq", "ne"])
    if rng.random() < 0.2:  # two constants: folded
        return binary(op, const(rng.choice(F_CONSTS)), const(rng.choice(F_CONSTS)))
    if rng.random() < 0.5:
        return binary(op, _float_tree(rng, depth), _float_tree(rng, depth))
    return binary(op, _int_tree(rng, depth), _int_tree(rng, depth))


def _envs(rng: random.Random, count: int) -> list[dict]:
    floats = F_CONSTS + [-2.5, 7.25, 1e-40, -3e38]
    ints = I_CONSTS + [-7, 5, -65536]
    return [{**{f"f{k}": np.float32(rng.choice(floats)) for k in range(3)},
             **{f"n{k}": rng.choice(ints) for k in range(3)}} for _ in range(count)]


def _same(a, b) -> bool:
    if isinstance(a, np.floating):
        return (np.isnan(a) and np.isnan(b)) or np.float32(a).tobytes() == np.float32(b).tobytes()
    return a == b and type(a) is type(b)


def _check_random(make, seed: int, trees: int, strict: bool = False) -> int:
    """Trees from `make`, evaluated before and after simplify on random inputs; returns how
    many trees simplify changed (so a run that tests nothing fails). `strict`: inputs on which
    the tree overflows a signed int (undefined in C) are skipped."""
    rng = random.Random(seed)
    changed = 0
    for _ in range(trees):
        tree = make(rng)
        simple = simplify(tree)
        changed += simple != tree
        for env in _envs(rng, 4):
            try:
                want = evaluate(tree, env, strict)
            except Undefined:
                continue
            got = evaluate(simple, env)
            assert _same(got, want), f"{tree!r}\n -> {simple!r}\n at {env}: {got!r} != {want!r}"
    return changed


def test_simplify_never_changes_a_float_result():
    assert _check_random(lambda rng: _float_tree(rng, 4), seed=1, trees=1500) > 300


def test_simplify_never_changes_an_int_result():
    assert _check_random(lambda rng: _int_tree(rng, 4), seed=2, trees=1500) > 300
    assert _check_random(lambda rng: _int_tree(rng, 3, I64), seed=3, trees=500) > 100


def test_the_evaluator_sees_c_semantics():
    """The reference itself (c_semantics.py): f32 rounding, truncating division, wrapping
    ints, -0.0 kept apart from 0.0."""
    env = {"f0": np.float32(-0.0), "n0": -7}
    assert not _same(evaluate(var("f0", F32) + 0.0, env), evaluate(var("f0", F32), env))
    assert evaluate(var("n0") / 2, env) == -3 and evaluate(var("n0") % 2, env) == -1
    assert evaluate(const(16777216.0) + const(1.0), env) == np.float32(16777216.0)
    assert evaluate(const(2 ** 31 - 1) + 1, env) == -2 ** 31
    assert evaluate(const(0.1) < const(float(np.float32(0.1))), env) is False
    assert BOOL == (var("n0") < 1).dtype and U32 != I32


# -- bit fields: a block decoder's byte offsets and shifts ----------------------------------
def _bit_tree(rng: random.Random, depth: int) -> K:
    """Index arithmetic as the block decoders write it: an index built as (s << k) | e or
    s * 2^k + e, then shifted, masked, scaled and offset."""
    if depth == 0 or rng.random() < 0.2:
        r = rng.random()
        if r < 0.3:
            return var(rng.choice(["n0", "n1"]))
        if r < 0.6:
            k = rng.randrange(0, 8)
            s = var(rng.choice(["n0", "n1"]))
            return (s << k if rng.random() < 0.5 else s * (1 << k)) | rng.randrange(0, 1 << k) if rng.random() < 0.5 \
                else (s << k if rng.random() < 0.5 else s * (1 << k)) + rng.randrange(-4, 1 << k)
        return const(rng.randrange(-8, 300))
    a = _bit_tree(rng, depth - 1)
    op = rng.choice(["shr", "shr", "and", "and", "add", "mul", "or", "shl", "sub"])
    if op == "shr":
        return a >> rng.randrange(0, 9)
    if op == "shl":
        return a << rng.randrange(0, 4)
    if op == "and":
        return a & ((1 << rng.randrange(0, 9)) - 1)
    if op == "mul":
        return a * rng.choice([1, 2, 4, 16, 32, 3, -2])
    return binary(op, a, _bit_tree(rng, depth - 1) if rng.random() < 0.5 else const(rng.randrange(0, 70)))


def test_simplify_never_changes_a_bit_field_result():
    """The shift rules assume, as C does, that signed ints do not overflow."""
    assert _check_random(lambda rng: _bit_tree(rng, 4), seed=4, trees=3000, strict=True) > 600


def _ops(node: K) -> set:
    return {node.op}.union(*(_ops(s) for s in node.src))


def test_a_decoder_index_folds_to_constants():
    """Element e of sub-block pair s of a Q4_K block (i = s << 6 | e): the byte
    16 + 32 * (i >> 6) + (i & 31) and the shift 4 * ((i >> 5) & 1), as blocks.bits writes them:
    the shift and which half of a u16 word the byte is fold to constants, and the byte and its
    word to s's part plus a constant, the same tree for the two bytes of a word."""
    s = var("s")
    words = {}
    for e in range(64):
        i = (s << 6) | e
        byte = 16 + 32 * (i >> 6) + (i & 31)
        assert _value(simplify(4 * ((i >> 5) & 1))) == 4 * (e >> 5)
        assert _value(simplify(byte & 1)) == e % 2
        word = words.setdefault((e % 32) // 2, simplify(byte >> 1))
        assert simplify(byte >> 1) == word
        for got, want in ((simplify(byte), lambda n: 16 + 32 * n + e % 32), (word, lambda n: (16 + 32 * n + e % 32) // 2)):
            assert not _ops(got) & {"or", "and"}, got
            assert all(evaluate(got, {"s": n}) == want(n) for n in range(5))


def test_trees_differing_in_a_zero_sign_are_different_trees():
    """simplify shares what it has simplified between kernels by structure, so structure must
    tell -0.0 from 0.0 (Python's == does not) and see a NaN constant as itself."""
    assert const(-0.0) != const(0.0) and const(math.nan) == const(math.nan)
    assert simplify(f * 0.0).src[1].arg == 0.0
    negative = simplify(f * -0.0).src[1].arg
    assert negative == 0.0 and math.copysign(1.0, negative) == -1.0
