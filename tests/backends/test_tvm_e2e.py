"""TVM end to end beyond what every backend shows (tests/backends/test_e2e.py): the
`dflash-compile --backend tvm-llvm` path writes a loadable artifact with its library."""
from dflash_ir.artifact import load_compiled, open_engine

PROMPT = [5, 77, 140, 9, 260, 31, 8]


def test_dflash_compile_writes_a_tvm_artifact(tvm, tiny_pair, tmp_path):
    from dflash_ir.cli.compile import main

    target, draft = tiny_pair("qwen35", "f16")
    assert main([str(target), str(draft), "-o", str(tmp_path / "art"), "--backend", "tvm-llvm", "-c", "96"]) == 0
    engine = load_compiled(tmp_path / "art", load_tokenizer=False)
    assert engine.info["backend"]["name"] == "tvm-llvm"
    assert list((tmp_path / "art" / "kernels").glob("tvm-llvm-*.so"))
    want = open_engine(target, draft, n_ctx=96).generate(prompt_ids=PROMPT, max_tokens=8, speculative=False,
                                                          ignore_eos=True).tokens
    assert engine.generate(prompt_ids=PROMPT, max_tokens=8, ignore_eos=True).tokens == want
