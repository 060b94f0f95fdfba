"""`llama` and `qwen3` targets against Transformers: LlamaForCausalLM / Qwen3ForCausalLM are
built here from a config (random weights, offline), exported by models/hf_export.py the way
llama.cpp's converter lays a file out, and our logits, tap features and greedy tokens are
compared with Transformers' (and llama.cpp's on the same file: an independent reader of
the layout, llama's q/k row permutation included)."""
import numpy as np
import pytest

from dflash_ir.artifact import compile_pair, load_compiled, open_engine
from dflash_ir.backends.base import get_backend
from dflash_ir.models.config import TargetConfig
from dflash_ir.models.generator import write_gguf
from dflash_ir.models.gguf_file import open_gguf
from dflash_ir.models.hf_export import hf_plan, permute_for_llama_cpp, unpermute_from_llama_cpp

import llama_cpp_child
from hf_reference import hf_greedy

torch = pytest.importorskip("torch", reason="torch is not installed (the oracle extra: pip install -e '.[oracle]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (the oracle extra)")

TOL = 3e-4  # ARCHITECTURE.md §8: f32-compute logits vs Transformers
LLAMA_CPP_TOL = 1e-4  # llama.cpp, f32 file and f32 KV cache (measured <= 9e-6)
PROMPTS = [[5, 77, 140, 9, 260, 31, 8, 101, 44], [300, 2, 17, 17, 250, 64, 1, 90, 133, 12, 7, 7, 61, 200, 3, 45]]
TAPS = (1, 0)  # in this order; HF hidden_states[-1] is after the final norm, so not the last layer
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
# Llama 3's RoPE scaling, with an original context short enough that the 8 frequencies of a
# 16-wide head take all three regimes at these positions: factor 1, interpolated, `factor`
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 100000.0}
# llama: tied embeddings, head dim = hidden / heads; qwen3: untied, head dim 32 (q width 128 != hidden);
# llama3: llama with LLAMA3_ROPE (a llama file with rope_freqs.weight)
ARCHS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, rope_theta=100000.0, tie_word_embeddings=True)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **COMMON, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False)),
    "llama3": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=True)),
}
GGUF_ARCH = {"llama3": "llama"}


def _randomise(model, seed: int) -> None:
    """Weights on the scale of trained ones (HF's init is too small to tell layouts apart)."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = rng.standard_normal(tuple(p.shape)).astype(np.float32)
            if name.endswith("norm.weight"):
                x = 1 + np.float32(0.1) * x
            elif "embed_tokens" in name:
                x *= np.float32(0.5)
            else:
                x /= np.float32(np.sqrt(p.shape[-1]))
            p.copy_(torch.from_numpy(x))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """`get(arch)` -> (Transformers model, path of its f32 GGUF export)."""
    made = {}

    def get(arch):
        if arch not in made:
            torch.manual_seed(0)
            model = ARCHS[arch]().eval()
            _randomise(model, seed=1)
            state = {k: v.numpy() for k, v in model.state_dict().items()}
            path = write_gguf(tmp_path_factory.mktemp(arch) / f"{arch}.gguf",
                              hf_plan(GGUF_ARCH.get(arch, arch), model.config.to_dict(), state))
            made[arch] = model, path
        return made[arch]

    return get


def _hf_forward(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].numpy(), [h[0].numpy() for h in out.hidden_states]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_features_and_greedy_match_transformers(hf, arch):
    model, path = hf(arch)
    engine = open_engine(path, n_ctx=128, taps=TAPS)
    for ids in PROMPTS:
        want_logits, hidden = _hf_forward(model, ids)
        engine.target.reset()
        out = engine.target.prefill(ids, all_logits=True)
        assert np.abs(out.logits - want_logits).max() <= TOL
        want_features = np.concatenate([hidden[t + 1] for t in TAPS], axis=1)  # HF hidden_states[id + 1]
        assert np.abs(out.features - want_features).max() <= TOL
        got = engine.generate(prompt_ids=ids, max_tokens=12, speculative=False, ignore_eos=True).tokens
        assert got == hf_greedy(model, ids, 12)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_opencl_logits_match_transformers(hf, arch, tmp_path):
    reason = get_backend("opencl").unavailable_reason()
    if reason:
        pytest.skip(f"opencl: {reason}")
    model, path = hf(arch)
    engine = load_compiled(compile_pair(path, out=tmp_path / "art", backend="opencl", n_ctx=64), load_tokenizer=False)
    for ids in PROMPTS:
        engine.target.reset()
        assert np.abs(engine.target.prefill(ids, all_logits=True).logits - _hf_forward(model, ids)[0]).max() <= TOL
        assert engine.generate(prompt_ids=ids, max_tokens=8, speculative=False,
                               ignore_eos=True).tokens == hf_greedy(model, ids, 8)


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_reads_the_export_as_transformers_computes_it(hf, arch):
    """llama.cpp is an independent reader of names, shapes and llama's q/k permutation."""
    model, path = hf(arch)
    runs = llama_cpp_child.greedy(path, PROMPTS, 8)
    for ids, run in zip(PROMPTS, runs):
        assert np.abs(np.array(run["last_logits"]) - _hf_forward(model, ids)[0][-1]).max() <= LLAMA_CPP_TOL
        assert run["tokens"] == hf_greedy(model, ids, 8)


def test_permutation_pairs_rotate_half_dims_as_adjacent_rows():
    """HF row s * D/2 + i of a head is row 2i + s after the converter's permutation."""
    heads, d = 3, 8
    w = np.arange(heads * d, dtype=np.float32)[:, None]
    p = permute_for_llama_cpp(w, heads)[:, 0].reshape(heads, d)
    for h in range(heads):
        for i in range(d // 2):
            assert p[h, 2 * i] == h * d + i and p[h, 2 * i + 1] == h * d + d // 2 + i
    assert np.array_equal(unpermute_from_llama_cpp(permute_for_llama_cpp(w, heads), heads), w)


@pytest.mark.parametrize("arch", ARCHS)
def test_export_config_reads_back(hf, arch):
    model, path = hf(arch)
    c = model.config
    cfg = TargetConfig.from_gguf(open_gguf(path))
    gguf_arch = GGUF_ARCH.get(arch, arch)
    assert (cfg.arch, cfg.n_layer, cfg.hidden, cfg.ff, cfg.n_head, cfg.n_head_kv) == (
        gguf_arch, c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads,
        c.num_key_value_heads)
    assert cfg.head_dim == (32 if arch == "qwen3" else c.hidden_size // c.num_attention_heads)
    assert cfg.tied_output == c.tie_word_embeddings
    assert cfg.layer_is_recurrent == (False,) * c.num_hidden_layers
    assert cfg.qk_norm == (arch == "qwen3") and cfg.permuted_qk == (gguf_arch == "llama")
    if arch == "llama3":  # wavelengths 2 pi / 10^(5 i / 8): 6.3 (< 64/4: 1), 27 (between), then > 64 (8)
        first, mid, *rest = cfg.rope_freq_factors
        assert len(rest) == 6 and first == 1 and 1 < mid < 8 and set(rest) == {8}
    else:
        assert cfg.rope_freq_factors == ()


def test_llama3_rope_scaling_shows_in_these_logits(hf):
    """The test above would see factors that are ignored: Transformers' own logits move when
    the same weights run without the scaling."""
    model, _ = hf("llama3")
    config = model.config.to_dict() | {"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    plain.load_state_dict(model.state_dict())
    assert np.abs(_hf_forward(model, PROMPTS[1])[0] - _hf_forward(plain, PROMPTS[1])[0]).max() > 100 * TOL

