"""Greedy tokens of a Transformers model, for tests comparing ours with it."""


def hf_greedy(model, ids, n):
    """n argmax tokens by full forwards (no generate(): its end-of-sequence rules are not ours)."""
    import torch

    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]
