"""Tiny generated model pairs shared by the runtime tests."""
import pytest

from dflash_ir.models.generator import tiny_draft_config, tiny_target_config, write_draft, write_target


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """`get(arch, dtype="f32")` -> (target path, draft path) of a generated random-weight pair."""
    made = {}

    def get(arch: str, dtype: str = "f32"):
        if (arch, dtype) not in made:
            d = tmp_path_factory.mktemp(f"{arch}-{dtype}")
            tcfg = tiny_target_config(arch, n_layer=4)
            write_target(d / "target.gguf", tcfg, dtype=dtype, seed=1)
            write_draft(d / "draft.gguf", tiny_draft_config(tcfg), target_cfg=tcfg, dtype=dtype, seed=2)
            made[arch, dtype] = (d / "target.gguf", d / "draft.gguf")
        return made[arch, dtype]

    return get
