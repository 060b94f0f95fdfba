"""One seeded optimisation loop for both models: AdamW, linear warm-up then cosine decay, clipping."""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch


def fit(params, loss_fn: Callable[[int], torch.Tensor], *, steps: int, lr: float, warmup: int = 100,
        weight_decay: float = 0.1, clip: float = 1.0, log: Callable[[str], None] = print, every: int = 50,
        check: Callable[[int], None] | None = None, check_every: int = 0) -> float:
    """Run `steps` steps of `loss_fn(step)`, calling `check(step)` after every `check_every`
    steps and the last (validation, keeping the best); returns the wall time in seconds."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    t0, running = time.perf_counter(), None
    for step in range(steps):
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if (step + 1) % every == 0 or step + 1 == steps:
            el = time.perf_counter() - t0
            log(f"step {step + 1}/{steps} loss {running:.3f} lr {sched.get_last_lr()[0]:.2e} {el:.0f}s "
                f"({el / (step + 1):.2f}s/step)")
        if check and ((step + 1) % check_every == 0 or step + 1 == steps):
            check(step + 1)
    return time.perf_counter() - t0
