"""Element masks (raystudy/core/finetune/masks.py): the top entries by score, and frozen entries that stay
bit-identical under AdamW with weight decay (which moves every entry whatever its gradient)."""

import torch

from raystudy.core.finetune.masks import hold_frozen_entries, top_elements
from tests.support.models import tiny_vit


def test_top_elements_by_hand():
    scores = {"a": torch.tensor([[0.5, 3.0], [float("nan"), 1.0]]), "b": torch.tensor([3.0, 0.1, 2.0])}
    masks = top_elements(scores, 3)  # 3.0 (a, first by order), 3.0 (b), 2.0 (b)
    assert masks["a"].tolist() == [[False, True], [False, False]]
    assert masks["b"].tolist() == [True, False, True]
    assert sum(int(m.sum()) for m in top_elements(scores, 100).values()) == 6  # NaN never chosen


def _train(masked: bool, steps: int = 4):
    torch.manual_seed(0)
    model = tiny_vit(num_classes=4)
    params = dict(model.named_parameters())
    names = ["blocks.1.attn.qkv.weight", "blocks.2.mlp.fc1.bias"]
    gen = torch.Generator().manual_seed(3)
    masks = {n: torch.rand(params[n].shape, generator=gen) < 0.3 for n in names}
    start = {n: p.detach().clone() for n, p in params.items()}
    opt = torch.optim.AdamW([params[n] for n in names], lr=1e-2, weight_decay=0.1)
    if masked:
        hold_frozen_entries(opt, params, masks)
    for _ in range(steps):
        x = torch.randn(4, 3, 32, 32, generator=gen)
        y = torch.randint(0, 4, (4,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return params, start, masks, names


def test_frozen_entries_stay_bit_identical_under_adamw_weight_decay():
    params, start, masks, names = _train(masked=True)
    for n in names:
        frozen, trained = ~masks[n], masks[n]
        assert torch.equal(params[n].detach()[frozen], start[n][frozen])  # bit for bit
        assert bool((params[n].detach()[trained] != start[n][trained]).all())  # every trained entry moved
        assert bool((params[n].grad[frozen] == 0).all())  # gradients zeroed: clipping sees trained ones only
    # without the hooks, weight decay alone moves the frozen entries: the check above can fail
    plain, start, masks, names = _train(masked=False)
    assert not torch.equal(plain[names[0]].detach()[~masks[names[0]]], start[names[0]][~masks[names[0]]])
