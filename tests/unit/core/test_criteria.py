"""Selection criteria (raystudy/core/criteria.py) against by-hand computations on a tiny ViT."""

import copy

import pytest
import torch

from raystudy.core.criteria import batch_gradients, element_scores, unit_scores
from raystudy.core.expressions import unit_parameters
from tests.support.models import tiny_vit


def _setup(n_batches=2, batch=3, seed=0):
    torch.manual_seed(seed)
    model = tiny_vit(num_classes=4)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 4, (batch,), generator=gen))
               for _ in range(n_batches)]
    units = unit_parameters(model)
    params = [(n, p) for ps in units.values() for n, p in ps]
    return model, batches, units, params


def _by_hand_grads(model, names, batches, per_sample):
    """Gradients by .backward() on a copy (train flags untouched there: eval mode, every parameter)."""
    ref = copy.deepcopy(model).eval()
    out = []
    for x, y in batches:
        rows = [(x[i:i + 1], y[i:i + 1]) for i in range(len(y))] if per_sample else [(x, y)]
        for xs, ys in rows:
            ref.zero_grad()
            torch.nn.CrossEntropyLoss()(ref(xs), ys).backward()
            grads = dict(ref.named_parameters())
            out.append({n: grads[n].grad.clone() for n in names})
    return out


@pytest.mark.parametrize("criterion", ["grad", "taylor", "fisher", "magnitude", "rgn"])
def test_element_scores_match_by_hand(criterion):
    model, batches, units, params = _setup()
    names = [n for n, _ in params]
    fisher = criterion == "fisher"
    hand = _by_hand_grads(model, names, batches, per_sample=fisher)
    assert len(hand) == (6 if fisher else 2)
    theta = dict(model.named_parameters())
    got = element_scores(criterion, params, batch_gradients(model, params, batches, per_sample=fisher))
    for n in names[:: max(1, len(names) // 7)]:
        gs = torch.stack([h[n] for h in hand])
        want = {"grad": gs.abs().sum(0), "taylor": (theta[n].detach() * gs.mean(0)).abs(),
                "fisher": gs.square().mean(0), "magnitude": theta[n].detach().abs(),
                "rgn": torch.full_like(theta[n], float(gs.mean(0).norm() / theta[n].detach().norm()))}[criterion]
        torch.testing.assert_close(got[n], want, rtol=1e-4, atol=1e-7)


def test_fisher_is_per_sample_not_per_batch():
    """The mean of per-sample squares exceeds the square of the batch mean (Jensen): they must differ."""
    model, batches, units, params = _setup(n_batches=1, batch=4)
    per_batch = element_scores("grad", params, batch_gradients(model, params, batches))
    fisher = element_scores("fisher", params, batch_gradients(model, params, batches, per_sample=True))
    n = params[1][0]
    assert bool((fisher[n] >= per_batch[n].square() - 1e-9).all())
    assert not torch.allclose(fisher[n], per_batch[n].square())


@pytest.mark.parametrize("criterion", ["grad", "fisher", "rgn", "magnitude"])
def test_unit_scores_are_means_or_concatenated_rgn(criterion):
    model, batches, units, params = _setup()
    fisher = criterion == "fisher"
    hand = _by_hand_grads(model, [n for n, _ in params], batches, per_sample=fisher)
    got = unit_scores(criterion, units, params, batch_gradients(model, params, batches, per_sample=fisher))
    assert set(got) == set(units) and len(got) == 15
    for unit in [("LN1", 0), ("MHA", 1), ("FC2", 2)]:
        ps = units[unit]
        if criterion == "rgn":
            g = torch.cat([torch.stack([h[n] for h in hand]).mean(0).flatten() for n, _ in ps])
            t = torch.cat([p.detach().flatten() for _, p in ps])
            want = float(g.norm() / t.norm())
        else:
            flat = []
            for n, p in ps:
                gs = torch.stack([h[n] for h in hand])
                flat.append({"grad": gs.abs().sum(0), "fisher": gs.square().mean(0),
                             "magnitude": p.detach().abs()}[criterion].flatten())
            want = float(torch.cat(flat).mean())
        assert got[unit] == pytest.approx(want, rel=1e-4)


def test_batch_gradients_restore_flags_and_mode():
    model, batches, units, params = _setup(n_batches=1)
    for _, p in params:
        p.requires_grad_(False)
    model.train()
    list(batch_gradients(model, params, batches))
    assert model.training and not any(p.requires_grad for _, p in params)
    assert all(p.grad is None for p in model.parameters())


def test_unknown_criterion_and_no_gradients():
    model, batches, units, params = _setup(n_batches=1)
    with pytest.raises(ValueError, match="unknown criterion"):
        element_scores("snip", params, [])
    with pytest.raises(ValueError, match="needs at least one gradient"):
        element_scores("grad", params, [])


def test_chunked_batches_give_the_batch_gradient():
    model, batches, units, params = _setup(n_batches=1, batch=5)
    whole = next(batch_gradients(model, params, batches))
    chunked = next(batch_gradients(model, params, batches, chunk=2))  # chunks of 2, 2, 1 rows
    for n, _ in params:
        torch.testing.assert_close(chunked[n], whole[n], rtol=1e-4, atol=1e-7)
