"""Configuration expressions: what a finetuning trial trains, beyond the paper's seven names.

Grammar (no whitespace; names are case-sensitive)::

    expression  := budgeted | adapter | combination
    combination := term ('+' term)*
    term        := NAME ('@' blocks)?             NAME: LN1 MHA LN2 FC1 FC2 Emb All Head bias; '@' after a
                                                  component or bias
    blocks      := span (',' span)*
    span        := INT ('-' INT)?                  inclusive and ascending: 8-11 is 8,9,10,11
    budgeted    := STRATEGY ':' budget (':weights')?
    STRATEGY    := 'auto' | 'random' | 'rgn' | 'grad' | 'taylor' | 'fisher' | 'magnitude'
    budget      := NUMBER ('%' | 'k' | 'M')?       % of All's parameter count, or a count: 2M, 500k, 1234
    adapter     := RANKED ':r=' INT targets? | 'ia3' targets?
    RANKED      := 'lora' | 'dora' | 'loha' | 'lokr' | 'vera'
    targets     := ':' TARGET (',' TARGET)*

Meaning (the classification head trains in every configuration and is never part of a selection here):

* ``MHA`` the component in every block (as :func:`~raystudy.core.components.trainable_parameters`),
  ``MHA@8-11`` in blocks 8 to 11 only, ``MHA+FC1`` the union; ``Emb``, ``All`` and ``Head`` as before.
* ``bias`` (BitFit): every ``*.bias`` parameter outside the head: the blocks' (both LayerNorms, ``qkv``,
  ``proj``, ``fc1``, ``fc2``) and the embedding's (the patch projection's); the final norm stays frozen as
  in every configuration (``train_final_norm``). ``bias@8-11`` the biases of blocks 8 to 11 only (no
  embedding bias); combinable like a component: ``LN1+LN2+bias``.
* ``auto:B`` the (component, block) *units* in decreasing order of measured plasticity, packed first-fit
  into the budget ``B``: a unit that would overflow the budget is skipped and the next, less plastic ones
  are still tried, so the selection never exceeds ``B`` and uses it as fully as the order allows.
  Units whose plasticity is NaN are never chosen. ``random:B`` packs the same units the same way in a
  random order drawn from the seed: the control that tells whether plasticity is what helps.
* ``rgn:B``, ``grad:B``, ``taylor:B``, ``fisher:B``, ``magnitude:B`` pack them the same way in decreasing
  score of a criterion of the literature (:mod:`raystudy.core.criteria`): does plasticity select better?
* ``<criterion>:B:weights`` (``fisher:0.1%:weights``) trains single entries instead of whole units: the
  ``B`` entries of the units' tensors with the largest element scores of the criterion over all of them
  together (:func:`raystudy.core.finetune.masks.top_elements`); ``random:B:weights`` ``B`` entries drawn
  uniformly from the seed (:func:`raystudy.core.budgets.random_elements`). ``B`` is read as for units (a
  percentage of ``All``'s count, or a count), the entries number exactly ``B``, capped at the units' entries.
  ``auto:B:weights`` is refused: plasticity is measured per unit, so it gives no order within a unit's
  tensors (every entry of a unit would tie), and its units are what ``auto:B`` already packs.
* ``lora:r=8`` low-rank adapters of rank 8 on every block's ``qkv`` and ``proj`` (the attention's input and
  output projections); ``lora:r=8:qkv,fc1`` on other linear layers, named relative to the block. ``dora:r=8``
  (weight-decomposed LoRA), ``loha:r=8`` (Hadamard product), ``lokr:r=8`` (Kronecker product) and
  ``vera:r=256`` (shared frozen random projections, trained scaling vectors) take the same targets;
  ``ia3`` (learned scaling vectors, no rank) defaults to ``qkv`` and ``fc2``. All through peft:
  :mod:`raystudy.core.peft_methods` (formulas, counts, why AdaLoRA is not one of them). A target no
  block has is an error at :func:`resolve`, with the caret under it.

:func:`canonical` spells an expression in one normalised way (terms in :data:`TERMS` order,
terms of one name merged, blocks sorted with runs written as ranges, ``All`` absorbing everything, a
redundant ``Head`` dropped, budgets as ``5%`` / ``2M`` / ``500k``, a method's default targets omitted): trial
ids and tables use it, and the paper's names are their own canonical spelling.

The parser is hand-written recursive descent: the grammar has ten rules and one character of lookahead,
and a parser library (lark, pyparsing) would add a dependency and still need our caret-style messages.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import NoReturn

from raystudy.core.budgets import Unit, first_fit, plasticity_order, random_elements, random_order, score_order
from raystudy.core.components import get_adapter, trainable_parameters
from raystudy.core.peft_methods import METHODS, TargetError, apply_method
from raystudy.vocab import COMPONENTS, CONFIGURATIONS, CRITERIA, did_you_mean

#: The words of a budget: plasticity (``auto``), the seeded random control, the criteria of the literature.
STRATEGIES: tuple[str, ...] = ("auto", "random") + CRITERIA
#: BitFit's term: every bias outside the head (a name a trial trains, not one of the paper's seven, so it is
#: not in :data:`~raystudy.vocab.CONFIGURATIONS`, whose order the paper's tables and colours follow).
BIAS = "bias"
#: The names a combination's term may take, in canonical order.
TERMS: tuple[str, ...] = CONFIGURATIONS + (BIAS,)
#: The names after which ``@blocks`` may follow.
PER_BLOCK: tuple[str, ...] = COMPONENTS + (BIAS,)
#: The words that start an expression other than a combination (``auto:``, ``lora:``, ``ia3``, ...).
WORDS: tuple[str, ...] = STRATEGIES + tuple(METHODS)
_MILLION, _THOUSAND = 1_000_000, 1_000


class ExpressionError(ValueError):
    """A configuration expression that does not parse; ``position`` indexes the offending character."""

    def __init__(self, expression: str, position: int, message: str):
        self.expression, self.position = expression, position
        super().__init__(f"invalid configuration {expression!r}: {message} (position {position})\n"
                         f"  {expression}\n  {' ' * position}^")


# --------------------------------------------------------------------------------------------------
# The tree
# --------------------------------------------------------------------------------------------------


def _spell_blocks(blocks: tuple[int, ...]) -> str:
    """Sorted blocks with every run of two or more written as a range: ``(0, 2, 8, 9, 10)`` -> ``0,2,8-10``."""
    parts, start = [], 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            first, last = blocks[start], blocks[i - 1]
            parts.append(str(first) if first == last else f"{first}-{last}")
            start = i
    return ",".join(parts)


@dataclass(frozen=True)
class Term:
    """One name of a combination; ``blocks`` sorted and unique, ``None`` for every block (or no blocks)."""

    name: str
    blocks: tuple[int, ...] | None = None

    def __str__(self) -> str:
        return self.name if self.blocks is None else f"{self.name}@{_spell_blocks(self.blocks)}"


@dataclass(frozen=True)
class Combination:
    """The union of its terms' parameters, e.g. ``MHA@8-11+FC1``."""

    terms: tuple[Term, ...]

    def __str__(self) -> str:
        return "+".join(str(t) for t in self.terms)

    def normalised(self) -> Combination:
        """The same selection spelled one way (see the module docstring)."""
        if any(t.name == "All" for t in self.terms):
            return Combination((Term("All"),))
        merged: dict[str, set[int] | None] = {}
        for t in self.terms:
            if t.name == "Head":
                continue
            if t.blocks is None or (t.name in merged and merged[t.name] is None):
                merged[t.name] = None
            else:
                merged[t.name] = merged.get(t.name, set()) | set(t.blocks)
        if not merged:
            return Combination((Term("Head"),))
        names = sorted(merged, key=TERMS.index)
        return Combination(tuple(Term(n, None if merged[n] is None else tuple(sorted(merged[n]))) for n in names))


@dataclass(frozen=True)
class Budget:
    """A trainable-parameter budget: ``amount`` percent of ``All`` (``unit == "%"``) or parameters (``""``)."""

    amount: float | int
    unit: str

    def parameters(self, total: int) -> int:
        """The budget in parameters for a model whose ``All`` has ``total``: ``floor(total * amount / 100)``."""
        if self.unit == "%":
            return math.floor(total * Fraction(repr(float(self.amount))) / 100)
        return int(self.amount)

    def __str__(self) -> str:
        if self.unit == "%":
            return format(Decimal(repr(float(self.amount))).normalize(), "f") + "%"
        n = int(self.amount)
        for scale, suffix in ((_MILLION, "M"), (_THOUSAND, "k")):
            if n % scale == 0:
                return f"{n // scale}{suffix}"
        return str(n)


#: the suffix of a budget at the granularity of single weights (``fisher:1%:weights``)
WEIGHTS_SUFFIX = "weights"


@dataclass(frozen=True)
class Budgeted:
    """``auto:B`` (by plasticity), ``random:B`` (seeded random order) or ``<criterion>:B`` (by a criterion's
    scores): units packed into ``budget``; with ``weights``, ``budget`` single entries (a mask)."""

    strategy: str
    budget: Budget
    weights: bool = False

    def __str__(self) -> str:
        return f"{self.strategy}:{self.budget}" + (f":{WEIGHTS_SUFFIX}" if self.weights else "")


@dataclass(frozen=True)
class Adapter:
    """A PEFT method (``lora:r=8``, ``dora:r=8:fc1,qkv``, ``ia3``): ``method`` a key of
    :data:`~raystudy.core.peft_methods.METHODS`, ``rank`` (``None`` for ``ia3``), ``targets`` sorted, unique."""

    method: str
    rank: int | None = None
    targets: tuple[str, ...] | None = None  # None: the method's default targets

    def __post_init__(self):
        if self.targets is None:
            object.__setattr__(self, "targets", METHODS[self.method].targets)

    def __str__(self) -> str:
        head = self.method if self.rank is None else f"{self.method}:r={self.rank}"
        return head if self.targets == METHODS[self.method].targets else head + ":" + ",".join(self.targets)


Expression = Combination | Budgeted | Adapter


# --------------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------------


class _Parser:
    """Recursive descent over ``text``; every method consumes what it parses and advances ``pos``."""

    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def fail(self, message: str, position: int | None = None) -> NoReturn:
        raise ExpressionError(self.text, self.pos if position is None else position, message)

    def found(self) -> str:
        return repr(self.text[self.pos]) if self.pos < len(self.text) else "the end"

    def accept(self, token: str) -> bool:
        if self.text.startswith(token, self.pos):
            self.pos += len(token)
            return True
        return False

    def match(self, pattern: str) -> str | None:
        m = re.compile(pattern).match(self.text, self.pos)
        if m is None:
            return None
        self.pos = m.end()
        return m.group()

    def integer(self, what: str) -> int:
        digits = self.match(r"\d+")
        if digits is None:
            self.fail(f"expected {what}, found {self.found()}")
        return int(digits)

    def expression(self) -> Expression:
        start = self.pos
        word = self.match(r"[a-z][a-z0-9]*")
        if word in STRATEGIES and self.accept(":"):
            result: Expression = self.budgeted(word, start)
        elif word in METHODS:
            result = self.adapter(word)
        else:
            self.pos = start
            result = self.combination()
        if self.pos < len(self.text):
            self.fail(f"unexpected {self.found()} after {self.text[start:self.pos]!r}")
        return result

    def combination(self) -> Combination:
        terms = [self.term()]
        while self.accept("+"):
            terms.append(self.term())
        return Combination(tuple(terms))

    def term(self) -> Term:
        start = self.pos
        name = self.match(r"[A-Za-z_][A-Za-z0-9_]*")
        if name is None:
            self.fail(f"expected a configuration name, found {self.found()}")
        if name not in TERMS:
            self.fail(f"unknown name {name!r}{did_you_mean(name, TERMS + WORDS) or ';'} expected one of "
                      f"{', '.join(TERMS)}, {', '.join(w + ':<budget>' for w in STRATEGIES)}, "
                      f"{':r=<rank>, '.join(m for m in METHODS if METHODS[m].ranked)}:r=<rank> "
                      f"or {', '.join(m for m in METHODS if not METHODS[m].ranked)}", start)
        if not self.accept("@"):
            return Term(name)
        if name not in PER_BLOCK:
            self.fail(f"{name} is not per block: '@' follows only {', '.join(PER_BLOCK)}", self.pos - 1)
        return Term(name, self.blocks())

    def blocks(self) -> tuple[int, ...]:
        chosen: set[int] = set()
        while True:
            first = last = self.integer("a block number")
            if self.accept("-"):
                at = self.pos
                last = self.integer("the last block of the range")
                if last < first:
                    self.fail(f"the range {first}-{last} is descending", at)
            chosen.update(range(first, last + 1))
            if not self.accept(","):
                return tuple(sorted(chosen))

    def budget(self) -> Budget:
        start = self.pos
        number = self.match(r"\d+(\.\d+)?")
        if number is None:
            self.fail(f"expected a budget (5%, 2M, 500k or 1234), found {self.found()}")
        if self.accept("%"):
            if not 0 < Decimal(number) <= 100:
                self.fail(f"a percentage must be in (0, 100], got {number}", start)
            return Budget(float(number), "%")
        count = Decimal(number) * (_MILLION if self.accept("M") else _THOUSAND if self.accept("k") else 1)
        if count != int(count) or count < 1:
            self.fail(f"{self.text[start:self.pos]} is not a positive whole number of parameters", start)
        return Budget(int(count), "")

    def budgeted(self, strategy: str, start: int) -> Budgeted:
        """After ``<strategy>:``: the budget, then optionally ``:weights`` (never after ``auto``)."""
        budget = self.budget()
        at = self.pos
        if not self.accept(":"):
            return Budgeted(strategy, budget)
        if self.match(r"[A-Za-z_]+") != WEIGHTS_SUFFIX:
            self.fail(f"expected '{WEIGHTS_SUFFIX}' after {self.text[start:at]!r}: a budget is followed only by "
                      "':weights' (single entries instead of whole units)", at + 1)
        if strategy == "auto":
            self.fail("auto:<budget>:weights has no meaning: plasticity is measured per (component, block) unit, "
                      "so it orders no entry within a unit; use auto:<budget>, or "
                      f"{'|'.join(('random',) + CRITERIA)}:<budget>:weights", start)
        return Budgeted(strategy, budget, weights=True)

    def adapter(self, name: str) -> Adapter:
        """After the method's word: ``:r=<rank>`` for a ranked method, then optional ``:targets``."""
        rank = None
        if METHODS[name].ranked:
            for token in (":", "r="):
                if not self.accept(token):
                    self.fail(f"expected '{':r=' if token == ':' else 'r='}<rank>' after "
                              f"{self.text[:self.pos]!r}, found {self.found()}")
            at = self.pos
            rank = self.integer("the rank")
            if rank < 1:
                self.fail("the rank must be at least 1", at)
        elif self.text.startswith(":r=", self.pos):
            self.fail(f"{name} takes no rank: write {name} or {name}:<targets>", self.pos + 1)
        if not self.accept(":"):
            return Adapter(name, rank)
        targets = [self.target()]
        while self.accept(","):
            targets.append(self.target())
        return Adapter(name, rank, tuple(sorted(set(targets))))

    def target(self) -> str:
        name = self.match(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
        if name is None:
            self.fail(f"expected a layer name such as qkv, proj, fc1 or fc2, found {self.found()}")
        return name


def parse(expr: str | Expression) -> Expression:
    """The tree of a configuration expression; raises :class:`ExpressionError` pointing at the bad character."""
    if isinstance(expr, (Combination, Budgeted, Adapter)):
        return expr
    if not isinstance(expr, str):
        raise TypeError(f"a configuration expression is a string, got {type(expr).__name__}")
    return _Parser(expr).expression()


def normalise(expr: str | Expression) -> Expression:
    """The tree of :func:`canonical`."""
    tree = parse(expr)
    return tree.normalised() if isinstance(tree, Combination) else tree


def canonical(expr: str | Expression) -> str:
    """The one spelling of ``expr`` (see the module docstring): ``FC1+MHA@11,8-10`` -> ``MHA@8-11+FC1``."""
    return str(normalise(expr))


def is_configuration(expr: object) -> bool:
    """Whether ``expr`` is a valid configuration expression."""
    try:
        parse(expr)  # type: ignore[arg-type]
    except (ExpressionError, TypeError):
        return False
    return True


def check_configuration(expr: str) -> str:
    """``expr`` unchanged if it parses; else :class:`ExpressionError` (a ``ValueError``) with the caret."""
    parse(expr)
    return expr


def path_safe(expr: str | Expression) -> str:
    """:func:`canonical` with ``:`` -> ``_`` and ``%`` -> ``pct``, for directory names and URIs:
    ``auto:5%`` -> ``auto_5pct``, ``lora:r=8:fc1,qkv`` -> ``lora_r=8_fc1,qkv``, ``ia3:fc1`` -> ``ia3_fc1``."""
    return canonical(expr).replace(":", "_").replace("%", "pct")


# --------------------------------------------------------------------------------------------------
# A budget's units as a combination
# --------------------------------------------------------------------------------------------------


def units_expression(units: list[Unit]) -> Combination:
    """The combination training exactly ``units``, normalised: ``[("MHA", 9), ("MHA", 8)]`` -> ``MHA@8-9``."""
    return Combination(tuple(Term(c, (b,)) for c, b in units)).normalised()


# --------------------------------------------------------------------------------------------------
# Resolving an expression on a model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Resolved:
    """What an expression trains on one model (the head excluded, as in ``trainable_parameters``).

    ``configuration``: the canonical expression; ``parameters``: ``(name, parameter)`` in
    ``model.named_parameters()`` order; ``units``: the (component, block) units in the order they were
    chosen (plasticity order for ``auto``, score order for a criterion; every unit a combination names, in
    depth order; empty for ``Emb``/``All``/``Head``/``bias`` alone and adapters); ``chosen``: a canonical
    expression training exactly these parameters (the units' combination for a budget, the configuration
    otherwise: record it in the trial row); ``budget``: the budget in parameters (``None`` without one).
    ``masks``: for ``:weights``, ``{name: bool mask}`` of the trained entries of each of ``parameters`` (the
    tensors the mask touches; ``units`` and ``chosen`` their units), ``None`` otherwise.
    """

    configuration: str
    parameters: tuple
    units: tuple[Unit, ...]
    chosen: str
    budget: int | None = None
    masks: dict | None = None

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.parameters]

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for _, p in self.parameters)


def unit_parameters(model, *, include_layerscale: bool = False) -> dict[Unit, list]:
    """Every (component, block) unit of ``model`` -> its ``(name, parameter)`` list, in depth order."""
    blocks = get_adapter(model).blocks()
    out: dict[Unit, list] = {}
    for i in range(len(blocks)):
        for c in COMPONENTS:
            out[(c, i)] = []
    for c in COMPONENTS:
        for name, p in trainable_parameters(model, c, include_layerscale=include_layerscale):
            i = next(i for i, b in enumerate(blocks) if name.startswith(b.prefix))
            out[(c, i)].append((name, p))
    return out


def _in_model_order(model, names: set[str]) -> tuple:
    return tuple((n, p) for n, p in model.named_parameters() if n in names)


def bias_parameters(model, blocks: tuple[int, ...] | None = None) -> list:
    """BitFit's parameters: every ``*.bias`` inside the blocks ``blocks`` (all blocks when ``None``) and, for
    all blocks, the embedding stage's (``Emb``'s biases: the patch projection's); never the head's or the
    final norm's. ``(name, parameter)`` in model order."""
    found = get_adapter(model).blocks()
    prefixes = tuple(found[b].prefix for b in (range(len(found)) if blocks is None else blocks))
    names = {n for n, _ in model.named_parameters() if n.endswith(".bias") and n.startswith(prefixes)}
    if blocks is None:
        names |= {n for n, _ in trainable_parameters(model, "Emb") if n.endswith(".bias")}
    return list(_in_model_order(model, names))


def _resolve_combination(model, tree: Combination, include_layerscale: bool) -> tuple[tuple, tuple[Unit, ...]]:
    """Parameters and units of a combination; ``ValueError`` for a block the model does not have."""
    per_unit = unit_parameters(model, include_layerscale=include_layerscale)
    depth = len(per_unit) // len(COMPONENTS)
    names: set[str] = set()
    units: list[Unit] = []
    for term in tree.terms:
        outside = [b for b in term.blocks or () if b >= depth]
        if outside:
            raise ValueError(f"configuration {str(term)!r}: block(s) {outside} out of range; the model has "
                             f"{depth} blocks (0-{depth - 1})")
        if term.name == BIAS:
            names |= {n for n, _ in bias_parameters(model, term.blocks)}
        elif term.name not in COMPONENTS:
            names |= {n for n, _ in trainable_parameters(model, term.name, include_layerscale=include_layerscale)}
        else:
            units += [(term.name, b) for b in (range(depth) if term.blocks is None else term.blocks)]
    for unit in units:
        names |= {n for n, _ in per_unit[unit]}
    return _in_model_order(model, names), tuple(sorted(units, key=lambda u: (u[1], COMPONENTS.index(u[0]))))


def element_budget(model, tree: Budgeted, include_layerscale: bool = False) -> int:
    """The entries a ``:weights`` budget trains on ``model``: ``B`` read as a unit budget is (a percentage of
    ``All``'s count, or a count), capped at the units' entries; ``ValueError`` below one entry."""
    candidates = sum(p.numel() for ps in unit_parameters(model, include_layerscale=include_layerscale).values()
                     for _, p in ps)
    budget = min(tree.budget.parameters(sum(p.numel() for _, p in trainable_parameters(model, "All"))), candidates)
    if budget < 1:
        raise ValueError(f"configuration {str(tree)!r}: the budget is below one parameter")
    return budget


def _resolve_weights(model, tree: Budgeted, masks, seed: int, include_layerscale: bool) -> Resolved:
    """The tensors ``masks`` touch (``random:B:weights`` draws its masks from ``seed`` when none are given),
    checked against the units' tensors and the budget."""
    per_unit = unit_parameters(model, include_layerscale=include_layerscale)
    shapes = {n: tuple(p.shape) for ps in per_unit.values() for n, p in ps}
    budget = element_budget(model, tree, include_layerscale)
    if masks is None:
        if tree.strategy != "random":
            raise ValueError(f"configuration {str(tree)!r} needs the mask of its {tree.strategy} scores")
        masks = random_elements(shapes, budget, seed)
    wrong = [n for n, m in masks.items() if shapes.get(n) != tuple(m.shape)]
    if wrong:
        raise ValueError(f"configuration {str(tree)!r}: mask(s) {wrong[:3]} name no unit tensor of that shape")
    count = sum(int(m.sum()) for m in masks.values())
    if not 0 < count <= budget:
        raise ValueError(f"configuration {str(tree)!r}: its mask holds {count:,} entries, not 1 to {budget:,}")
    touched = {n: m.bool() for n, m in masks.items() if bool(m.any())}
    units = [u for u, ps in per_unit.items() if any(n in touched for n, _ in ps)]
    units.sort(key=lambda u: (u[1], COMPONENTS.index(u[0])))
    return Resolved(str(tree), _in_model_order(model, set(touched)), tuple(units), str(units_expression(units)),
                    budget, touched)


def _resolve_budget(model, tree: Budgeted, plasticity, scores, seed: int, include_layerscale: bool,
                    random_stand_in: bool = False) -> Resolved:
    """First-fit packing of the units into the budget, in plasticity, criterion or seeded random order (the
    last whatever the strategy with ``random_stand_in``)."""
    per_unit = unit_parameters(model, include_layerscale=include_layerscale)
    sizes = {u: sum(p.numel() for _, p in ps) for u, ps in per_unit.items()}
    total = sum(p.numel() for _, p in trainable_parameters(model, "All"))
    budget = tree.budget.parameters(total)
    if random_stand_in:
        order = random_order(list(per_unit), seed)
    elif tree.strategy == "auto":
        if plasticity is None:
            raise ValueError(f"configuration {str(tree)!r} needs the dataset's plasticity table")
        order = plasticity_order(list(per_unit), plasticity)
    elif tree.strategy in CRITERIA:
        if scores is None:
            raise ValueError(f"configuration {str(tree)!r} needs the units' {tree.strategy} scores")
        order = score_order(list(per_unit), scores)
    else:
        order = random_order(list(per_unit), seed)
    chosen = first_fit(order, sizes, budget)
    if not chosen:
        raise ValueError(f"configuration {str(tree)!r}: the budget of {budget:,} parameters is below the "
                         f"smallest unit ({min(sizes[u] for u in order):,} parameters)")
    names = {n for u in chosen for n, _ in per_unit[u]}
    return Resolved(str(tree), _in_model_order(model, names), tuple(chosen), str(units_expression(chosen)), budget)


def _target_position(tree: Adapter, target: str) -> int:
    """Where ``target`` starts in ``str(tree)``; its end when the targets are the method's default (unwritten)."""
    text = str(tree)
    if tree.targets == METHODS[tree.method].targets:
        return len(text)
    at = text.rindex(":") + 1
    for name in text[at:].split(","):
        if name == target:
            return at
        at += len(name) + 1
    return len(text)


def resolve(model, expr: str | Expression, *, plasticity=None, scores: dict[Unit, float] | None = None,
            masks: dict | None = None, seed: int = 0, include_layerscale: bool = False,
            random_stand_in: bool = False) -> Resolved:
    """The parameters ``expr`` trains on ``model`` (head excluded; the caller adds it).

    ``plasticity``: the dataset's plasticity table, needed by ``auto:B`` (see :func:`plasticity_order`);
    ``scores``: ``{unit: score}`` of the expression's criterion, needed by ``<criterion>:B``
    (:func:`raystudy.core.criteria.unit_scores`; see :func:`~raystudy.core.budgets.score_order`);
    ``masks``: ``{name: bool mask}`` of ``<criterion>:B:weights`` (the top entries of its element scores);
    ``seed``: the order of ``random:B``, the entries of ``random:B:weights`` and the initialisation of an
    adapter's random factors. ``random_stand_in``: a budget's units packed in ``random:B``'s order whatever its
    strategy (a count before the plasticity or the scores exist: the same budget, the same units' sizes), its
    errors naming the expression as given.
    **An adapter modifies ``model`` in place**: it wraps the target layers
    (:func:`raystudy.core.peft_methods.apply_method`), so their weights are named ``...qkv.base_layer.weight``
    from then on; the returned parameters are the adapters' (``lora_A`` / ``lora_B``, ``ia3_l``, ...). A
    target no block has raises :class:`ExpressionError` with the caret under it. A meta-device model gives
    the counts without memory.
    """
    tree = normalise(expr)
    if isinstance(tree, Budgeted) and tree.weights:
        return _resolve_weights(model, tree, masks, seed, include_layerscale)
    if isinstance(tree, Budgeted):
        return _resolve_budget(model, tree, plasticity, scores, seed, include_layerscale, random_stand_in)
    if isinstance(tree, Adapter):
        try:
            params = apply_method(model, tree.method, tree.rank, tree.targets, seed=seed)
        except TargetError as e:
            raise ExpressionError(str(tree), _target_position(tree, e.targets[0]), str(e)) from None
        return Resolved(str(tree), tuple(params), (), str(tree))
    params, units = _resolve_combination(model, tree, include_layerscale)
    return Resolved(str(tree), params, units, str(tree))
