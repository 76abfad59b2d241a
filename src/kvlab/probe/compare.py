"""When is an answer *contaminated* by another prompt, rather than merely different?

An answer A to prompt i is compared with its own reference R_i (prompt i alone) and with the other prompts'
references R_j. Write cp(x, y) for the length of the common prefix. If A follows R_i past the point
c_ij = cp(R_i, R_j) where the two references part, it cannot follow R_j there; so the evidence that A came
from prompt j's state is how far A follows R_j *beyond* c_ij: ``excess = cp(A, R_j) - c_ij``.

Chance produces some excess too: unrelated answers often start alike (a newline, "The", a frequent first
word), and text compared character by character shares letters by the dozen. So the minimum excess is
calibrated on the run's own material: the longest common prefix among pairs of references of *unrelated*
prompts (different groups, plus a few calibration prompts) is what chance achieved; contamination needs
more than that, and never less than a floor (``MIN_MATCH``). The report states the number, its unit and
the pairs it came from. Token ids are compared where the server gives them; text otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvlab.probe.client import Answer

# The least excess that can count as contamination, whatever the calibration says: a few tokens, or in text a
# few words' worth of characters (a shared word or two is common between unrelated answers).
MIN_MATCH = {"tokens": 4, "characters": 16}


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Criterion:
    unit: str  # tokens | characters
    min_match: int  # excess needed beyond the references' common prefix
    chance_max: int  # the longest common prefix of any unrelated pair of references
    pairs: int  # how many unrelated pairs that was measured on
    floor: int

    def statement(self) -> str:
        if not self.pairs:
            return (
                f"contaminated = follows another prompt's reference for at least {self.min_match} {self.unit} beyond "
                "where the two references part (the floor: no unrelated references to calibrate on)"
            )
        return (
            f"contaminated = follows another prompt's reference for at least {self.min_match} {self.unit} beyond "
            f"where the two references part; unrelated references shared at most {self.chance_max} {self.unit} "
            f"(longest common prefix over {self.pairs} pairs), so chance met the criterion in none of them "
            f"(rate < {3 / self.pairs:.2g} at 95%); floor {self.floor} {self.unit}"
        )


def calibrate(refs: Sequence[tuple[str, Answer]], unit: str) -> Criterion:
    """The criterion from references labelled by family (prompts of one family are related)."""
    longest, pairs = 0, 0
    for i, (fam_a, a) in enumerate(refs):
        for fam_b, b in refs[i + 1 :]:
            if fam_a != fam_b:
                pairs += 1
                longest = max(longest, common_prefix(a.key(), b.key()))
    floor = MIN_MATCH[unit]
    return Criterion(unit, max(longest + 1, floor), longest, pairs, floor)


@dataclass
class Verdict:
    outcome: str  # same | diverged | contaminated
    own_prefix: int  # cp with its own reference
    closest_other: int | None  # the other prompt it follows furthest beyond the references' parting
    other_prefix: int  # cp with that prompt's reference
    excess: int  # how far beyond the parting point (contaminated: >= criterion.min_match)


def classify(answer: Answer, own: int, refs: Sequence[Answer], criterion: Criterion) -> Verdict:
    """Compare ``answer`` to prompt ``own`` with the group's references (see the module docstring)."""
    key, mine = answer.key(), refs[own].key()
    own_p = common_prefix(key, mine)
    if key == mine:
        return Verdict("same", own_p, None, 0, 0)
    best: tuple[int, int, int] | None = None  # (excess, index, cp)
    for j, ref in enumerate(refs):
        other = ref.key()
        if j == own or other == mine:  # a reference equal to ours says nothing about where tokens came from
            continue
        p = common_prefix(key, other)
        excess = p - common_prefix(mine, other)
        if best is None or excess > best[0]:
            best = (excess, j, p)
    if best is not None and best[0] >= criterion.min_match:
        return Verdict("contaminated", own_p, best[1], best[2], best[0])
    return Verdict("diverged", own_p, best[1] if best else None, best[2] if best else 0, max(best[0], 0) if best else 0)


def reachable(refs: Sequence[Answer], criterion: Criterion) -> bool:
    """Can any answer of this group meet the criterion at all? (Answers too short to beat chance cannot.)"""
    keys = [r.key() for r in refs]
    return any(len(b) - common_prefix(a, b) >= criterion.min_match for i, a in enumerate(keys) for b in keys if b != a)


def fisher_greater(k1: int, n1: int, k2: int, n2: int) -> float:
    """One-sided Fisher exact test, scipy's ``fisher_exact`` with alternative "greater": the chance that group 1
    (``k1`` events in ``n1`` trials) has at least ``k1`` events if both groups had the same rate, given the
    pooled count. 1.0 where a group or the pooled count is empty: no evidence either way."""
    from scipy.stats import fisher_exact  # imported here: importing the probe stays cheap

    return float(fisher_exact([[k1, n1 - k1], [k2, n2 - k2]], alternative="greater").pvalue)
