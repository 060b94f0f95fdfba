"""The kernel printers (backends/kir/printer.py, c.py, glsl.py): C precedence with the fewest
parentheses, GLSL keywords renamed, f32 literals that read back as the same f32 (shortest
decimal), infinities and NaN. Printed kernels run on PoCL and lavapipe where marked by their
fixtures (skipped without the device); the rest needs none."""
import math
import random
import re

import numpy as np
import pytest

from dflash_ir.backends.kir import F32, I32, KernelBuilder, cast, const, maximum, minimum, select, var
from dflash_ir.backends.kir.build import binary
from dflash_ir.backends.kir.c import PRINTERS
from dflash_ir.backends.kir.glsl import BASELINE, FULL, GLSLPrinter
from dflash_ir.backends.kir.printer import Printer

from c_semantics import Undefined, evaluate

a, b, c, f = var("a"), var("b"), var("c"), var("f", F32)


def _printers():
    return {"opencl": PRINTERS["opencl"], "cuda": PRINTERS["cuda"], "glsl": GLSLPrinter(None, FULL)}


@pytest.mark.parametrize("tree, text", [
    (a - (b - c), "a - (b - c)"), ((a - b) - c, "a - b - c"), (a / (b * c), "a / (b * c)"),
    (a * b / c, "a * b / c"), ((a + b) * c, "(a + b) * c"), (a + b * c, "a + b * c"),
    (a % (b / c), "a % (b / c)"), ((a << 2) + b, "(a << 2) + b"), (a << (b + c), "a << b + c"),
    ((a & b).eq(c), "(a & b) == c"), (a & (b + c), "a & b + c"), ((a & b) + c, "(a & b) + c"),
    ((a | b) ^ c, "(a | b) ^ c"),
    (-(a + b), "-(a + b)"), (-(-a), "-(-a)"), (a - const(-1), "a - -1"), (-const(-1), "-(-1)"),
    (~(a & b), "~(a & b)"), ((a < b) & (b < c), "a < b && b < c"), (((a < b) | (b < c)) & (c < a),
                                                                 "(a < b || b < c) && c < a"),
    (select(a < b, select(b < c, a, b), c), "a < b ? (b < c ? a : b) : c"),
    (select(a < b, a, select(b < c, b, c)), "a < b ? a : b < c ? b : c"),
    (select(a < b, a, b) + c, "(a < b ? a : b) + c")])
def test_precedence_takes_the_fewest_parentheses(tree, text):
    for name, printer in _printers().items():
        assert printer.expr(tree) == text, name


@pytest.mark.parametrize("tree, c_text, glsl_text", [
    (cast(F32, a + b), "(float)(a + b)", "float(a + b)"),
    (cast(F32, a) + f, "(float)a + f", "float(a) + f"),
    (cast(F32, a) / cast(F32, b), "(float)a / (float)b", "float(a) / float(b)"),
    (cast(I32, f * 2.0), "(int)(f * 2.0f)", "int(f * 2.0)"),
    (cast(I32, -f), "(int)-f", "int(-f)")])
def test_casts_bind_tighter_than_any_operator(tree, c_text, glsl_text):
    assert PRINTERS["opencl"].expr(tree) == c_text and PRINTERS["cuda"].expr(tree) == c_text
    assert GLSLPrinter(None, FULL).expr(tree) == glsl_text


def test_min_and_max_follow_the_operand_type():
    assert PRINTERS["opencl"].expr(minimum(f, 1.0)) == "fmin(f, 1.0f)" and PRINTERS["opencl"].expr(
        maximum(a, b)) == "max(a, b)"
    assert PRINTERS["cuda"].expr(minimum(f, 1.0)) == "fminf(f, 1.0f)" and PRINTERS["cuda"].expr(
        maximum(a, b)) == "max(a, b)"
    assert GLSLPrinter(None, FULL).expr(maximum(f, a)) == "max(f, float(a))"


# -- the printed precedence, run: random integer expressions on PoCL ---------------------------
INPUTS = np.array([7, -3, 12, -100, 1 << 20, 5], np.int32)


def _tree(rng: random.Random, depth: int, leaves: list):
    """A random integer tree over `leaves` and small constants."""
    if depth == 0 or rng.random() < 0.2:
        if rng.random() < 0.6:
            return rng.choice(leaves)
        return const(rng.choice([0, 1, 2, 3, -1, -7, 13, 1000]))

    def sub():
        return _tree(rng, depth - 1, leaves)

    r = rng.random()
    if r < 0.1:
        return select(binary(rng.choice(["lt", "le", "gt", "ge", "eq", "ne"]), sub(), sub()), sub(), sub())
    if r < 0.15:
        return -sub()
    if r < 0.2:
        return ~sub()
    if r < 0.25:  # a float detour: casts around a division
        return cast(I32, cast(F32, sub()) / 2.0)
    if r < 0.3:
        return cast(I32, binary(rng.choice(["lt", "eq", "ne"]), sub(), sub()) & binary(rng.choice(["gt", "ge"]), sub(),
                                                                                        sub()))
    if r < 0.38:
        return binary(rng.choice(["shl", "shr"]), sub(), const(rng.randrange(5)))
    op = rng.choice(["add", "sub", "mul", "div", "mod", "and", "or", "xor", "min", "max", "add", "sub", "mul"])
    return binary(op, sub(), sub())


def test_printed_expressions_compute_what_the_tree_means(run_opencl):
    """Random integer trees (every operator, casts, selects, comparisons, shifts) printed as
    OpenCL and run on PoCL equal the tree's value in C (c_semantics.py); trees whose value C
    leaves undefined (overflow, division by zero, bad shifts) are left out."""
    kb = KernelBuilder("exprs", (1,))
    xs, out = kb.buffer("xs", "i32"), kb.buffer("out", "i32", writes=True)
    leaves = [xs[k] for k in range(len(INPUTS))]
    rng, env, want = random.Random(5), {("load", "xs"): [int(v) for v in INPUTS]}, []
    while len(want) < 400:
        tree = _tree(rng, 5, leaves)
        try:
            want.append(evaluate(tree, env, strict=True))
        except Undefined:
            continue
        out[len(want) - 1] = tree
    kernel = kb.build()
    source = PRINTERS["opencl"].kernel_source(kernel)
    assert source.count("(") < 40 * len(want), "far more parentheses than precedence needs"
    got = run_opencl(kernel, (1,), {"xs": INPUTS, "out": np.zeros(len(want), np.int32)})["out"]
    mismatched = [(i, g, w) for i, (g, w) in enumerate(zip(got.tolist(), want)) if g != w]
    assert not mismatched, mismatched[:5]
    assert len(set(want)) > 100  # the trees are not all one value


# -- identifiers --------------------------------------------------------------------------
def test_glsl_keywords_get_a_trailing_underscore_and_c_names_stay():
    glsl = GLSLPrinter(None, BASELINE)
    for name in ("out", "input", "sample", "filter", "half", "shared", "buffer", "dot", "mix", "step"):
        assert glsl.expr(var(name)) == name + "_" and PRINTERS["cuda"].expr(var(name)) == name
    for name in ("acc", "x", "o", "output_", "outer", "samples"):
        assert glsl.expr(var(name)) == name


# -- literals -----------------------------------------------------------------------------
def _random_f32(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 1 << 32, count, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    edge = np.array([0.0, -0.0, 1.0, 0.1, 1e-5, 9.99e-6, 1e16, 123456789.0, 16777217.0, 3.4028235e38, -3.4028235e38,
                     1.1754944e-38, 1.4e-45, -1.4e-45, 2.5, 1 / 3], np.float32)
    return np.concatenate([edge, values[np.isfinite(values)]])


def _digits(text: str) -> str:
    mantissa = re.split("[eE]", text.lstrip("-"))[0].replace(".", "")
    return mantissa.strip("0") or "0"


def test_f32_literals_are_the_shortest_decimal_that_reads_back():
    for v in _random_f32(5000, 1):
        text = Printer.shortest_f32(float(v))
        assert "." in text, text  # a float literal in C and GLSL, never an int
        assert np.float32(text).tobytes() == v.tobytes(), (v, text)
        digits = len(_digits(text))
        if digits > 1 and v != 0:  # one digit fewer reads back as another f32
            assert np.float32(f"{float(v):.{digits - 2}e}") != v, (v, text)


def _literal_kernel(values) -> object:
    kb = KernelBuilder("literals", (1,))
    out = kb.buffer("out", "f32", writes=True)
    for i, v in enumerate(values):
        out[i] = const(float(v))
    return kb.build()


SPECIAL = np.array([np.inf, -np.inf, np.nan], np.float32)


def _check_literals(got: np.ndarray, values: np.ndarray) -> None:
    n = len(values) - len(SPECIAL)
    np.testing.assert_array_equal(got[:n].view(np.uint32), values[:n].view(np.uint32))
    assert got[n] == np.inf and got[n + 1] == -np.inf and np.isnan(got[n + 2])


def test_literals_read_back_exactly_in_opencl(run_opencl):
    values = np.concatenate([_random_f32(600, 2), SPECIAL])
    kernel = _literal_kernel(values)
    assert "INFINITY" in PRINTERS["opencl"].kernel_source(kernel) and "NAN" in PRINTERS["opencl"].kernel_source(kernel)
    _check_literals(run_opencl(kernel, (1,), {"out": np.zeros(len(values), np.float32)})["out"], values)


def test_literals_read_back_exactly_in_glsl(run_vulkan):
    """Subnormals aside: Vulkan lets a device flush them."""
    finite = _random_f32(600, 3)
    values = np.concatenate([finite[np.abs(finite) >= np.finfo(np.float32).tiny], SPECIAL])
    _check_literals(run_vulkan(_literal_kernel(values), BASELINE, (1,), {"out": np.zeros(len(values), np.float32)})[
        "out"], values)


def test_cuda_and_glsl_spell_the_special_values():
    assert [PRINTERS["cuda"].expr(const(v)) for v in (math.inf, -math.inf, math.nan)] == ["INFINITY", "-INFINITY",
                                                                                         "NAN"]
    glsl = GLSLPrinter(None, FULL)
    assert [glsl.expr(const(v)) for v in (math.inf, -math.inf, math.nan)] == [
        "uintBitsToFloat(0x7f800000u)", "-uintBitsToFloat(0x7f800000u)", "uintBitsToFloat(0x7fc00000u)"]
    assert PRINTERS["opencl"].expr(f - const(-math.inf)) == "f - -INFINITY"
