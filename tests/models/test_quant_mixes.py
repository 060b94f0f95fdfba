"""Mixed-type files as llama-quantize makes them, end to end: a generated qwen35 target (F16),
quantised by llama.cpp's own llama_model_quantize to its presets (Q4_K_M: Q4_K with Q6_K for
some attention/FFN tensors and the embedding, Q5_0 / Q8_0 where a row is not whole 256-blocks;
...), run by the interpreter, by OpenCL (both device profiles) and by llama.cpp.

llama.cpp multiplies quantised weights with activations rounded to 8 bits (Q8_K, Q8_0, Q8_1),
which moves this random model's logits by up to ~10%; we multiply exact f32 activations. So the
exact check is llama.cpp on a copy of the file dequantised by gguf-py (an independent decoder)
to F32: same greedy tokens as ours on the quantised file. On the quantised file itself the
greedy tokens are compared on a tied-embedding target, whose greedy margins (the last token's
own embedding) are far above that noise; an untied random target's are not."""
import gguf
import numpy as np
import pytest

from dflash_ir.artifact import compile_pair, load_compiled, open_engine
from dflash_ir.backends.base import get_backend
from dflash_ir.benchmark.peer import PeerCrashed, peer_unavailable, quantize, run_llama_cpp
from dflash_ir.dtypes import DType
from dflash_ir.models.generator import tiny_draft_config, tiny_target_config, write_draft, write_target
from dflash_ir.models.gguf_file import open_gguf

PROMPTS = [[5, 77, 140, 9, 260, 31, 8, 101, 44], [300, 2, 17, 17, 250, 64, 1, 90, 133, 12, 7, 7, 61, 200, 3, 45]]
TOKENS = 12
# preset -> the block types llama-quantize gives this target (rows of 256, except ffn_down's 384)
PRESETS = {
    "Q4_K_M": {DType.Q4_K, DType.Q6_K, DType.Q5_0, DType.Q8_0},
    "Q5_K_M": {DType.Q5_K, DType.Q6_K, DType.Q5_1, DType.Q8_0},
    "Q2_K": {DType.Q2_K, DType.Q3_K, DType.Q4_K, DType.Q4_0, DType.Q6_K},
    "IQ4_XS": {DType.IQ4_XS, DType.IQ4_NL, DType.Q5_K, DType.Q6_K},
    "Q4_1": {DType.Q4_1, DType.Q6_K},
}
OPENCL_TOL = 1e-3  # relative to max |logit|: f32 kernels summing in their own order


def _skip_without_llama_cpp() -> None:
    reason = peer_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """`get(preset, tied)` -> path of the target quantised to `preset` by llama.cpp."""
    made = {}

    def get(preset: str, tied: bool = False):
        if (preset, tied) not in made:
            _skip_without_llama_cpp()
            d = tmp_path_factory.mktemp(f"{preset}-{'tied' if tied else 'untied'}")
            cfg = tiny_target_config("qwen35", hidden=256, ff=384, n_head=8, ssm_d_state=64, tied_output=tied)
            target = write_target(d / "target-f16.gguf", cfg, dtype="f16", seed=3)
            draft = write_draft(d / "draft-f16.gguf", tiny_draft_config(cfg), target_cfg=cfg, dtype="f16", seed=4)
            try:
                made[preset, tied] = (quantize(target, d / f"target-{preset}.gguf", preset),
                                      quantize(draft, d / f"draft-{preset}.gguf", preset))
            except PeerCrashed as e:
                pytest.skip(str(e))
        return made[preset, tied][0]

    get.pair = lambda preset: (get(preset), made[preset, False][1])
    return get


def _dequantised_copy(src, dst):
    """The file with every tensor dequantised to F32 by gguf-py, metadata as it was."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            kind = field.types[0]
            writer.add_key_value(name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _ours(engine, speculative: bool = False) -> list[list[int]]:
    """Greedy tokens of each prompt; speculative: every round verifies n_max (15) proposals."""
    kw = dict(speculative=True, adaptive=False) if speculative else dict(speculative=False)
    return [engine.generate(prompt_ids=ids, max_tokens=TOKENS, ignore_eos=True, **kw).tokens for ids in PROMPTS]


def _llama_cpp(path) -> list[list[int]]:
    try:
        return [run_llama_cpp("mix", path, ids, TOKENS, n_ctx=64, threads=1).tokens for ids in PROMPTS]
    except PeerCrashed as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_gives_the_mix_of_types(mixed, preset):
    with open_gguf(mixed(preset)) as f:
        assert {t.dtype for t in f.tensors.values() if t.dtype.is_block} == PRESETS[preset]


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_equals_llama_cpp_on_the_dequantised_file(mixed, preset, tmp_path):
    path = mixed(preset)
    ours = _ours(open_engine(path, n_ctx=64))
    assert len({t for run in ours for t in run}) > 4  # not a model that repeats one token
    assert ours == _llama_cpp(_dequantised_copy(path, tmp_path / "f32.gguf"))


@pytest.mark.parametrize("preset", ["Q4_K_M", "IQ4_XS"])
def test_greedy_equals_llama_cpp_on_the_same_file(mixed, preset):
    path = mixed(preset, tied=True)
    assert _ours(open_engine(path, n_ctx=64)) == _llama_cpp(path)


def test_a_quantised_pair_decodes_speculatively_as_the_target_alone(mixed):
    """DFlash drafts ship as Q4_K_M too: llama.cpp quantises the generated draft as well."""
    target, draft = mixed.pair("Q4_K_M")
    with open_gguf(draft) as f:
        assert {DType.Q4_K, DType.Q6_K} <= {t.dtype for t in f.tensors.values()}
    engine = open_engine(target, draft, n_ctx=64)
    assert _ours(engine, speculative=True) == _ours(engine)


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_opencl_equals_the_interpreter(mixed, profile, tmp_path, monkeypatch):
    reason = get_backend("opencl").unavailable_reason()
    if reason:
        pytest.skip(f"opencl: {reason}")
    monkeypatch.setenv("DFLASH_IR_PROFILE", profile)
    path, draft = mixed.pair("Q4_K_M")
    reference = open_engine(path, n_ctx=64)
    engine = load_compiled(compile_pair(path, draft, out=tmp_path / "art", backend="opencl", n_ctx=64),
                           load_tokenizer=False, measure_costs=False)
    for ids in PROMPTS:
        reference.target.reset()
        engine.target.reset()
        want = reference.target.prefill(ids, all_logits=True).logits
        got = engine.target.prefill(ids, all_logits=True).logits
        assert np.abs(got - want).max() <= OPENCL_TOL * np.abs(want).max()
    assert _ours(engine) == _ours(engine, speculative=True) == _ours(reference)
