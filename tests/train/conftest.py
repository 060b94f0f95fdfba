"""Tests of the training code (train/, needs torch: the `train` extra) and of the shipped demo pair."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # train/ is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

# A small target with every feature of the real one: 2 k-heads / 4 v-heads (tiled order matters),
# partial rotary with sections, LLLA pattern.
TINY = dict(vocab_size=512, hidden=64, n_layer=4, n_head=4, n_head_kv=2, head_dim=32, n_rot=8,
            rope_sections=(2, 1, 1, 0), ff=96, ssm_k_heads=2, ssm_v_heads=4, ssm_head_dim=32)


@pytest.fixture
def tiny_hp():
    from train.target import TargetHParams

    return TargetHParams(**TINY)


@pytest.fixture
def random_target(tiny_hp):
    """Every parameter perturbed, so that a missed `+1`, sign or head permutation shows."""
    torch = pytest.importorskip("torch")
    from train.target import Target

    torch.manual_seed(0)
    model = Target(tiny_hp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 8)))
            elif p.ndim == 1 or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 1 / p.shape[-1] ** 0.5 if p.ndim == 2 else 0.5)
        model.embed_tokens.weight.normal_(0, 0.5)
    return model
