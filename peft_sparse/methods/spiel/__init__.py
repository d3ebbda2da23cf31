r"""SpIEL: sparse fine-tuning whose indices η move during training (thesis ch. 7, Algorithms 2–3).

Notation (as in §7.4.3, not as in the algorithms' pseudocode): every **S** optimizer steps
(``reselection_steps``) each tensor i *drops* k(i, t) of its d_φ(i) active weights and *grows*
k(i, t) new ones. The first reselection, at t = γ, replaces all of them (Eq. 7.6); k then decays
(linear Eq. 7.6 or cosine Eq. E.1, see :mod:`peft_sparse.schedules.reselection`).

* **DROP** — the k active weights with the smallest |φ| (§7.3.1 text; ties → lowest flat index).
* **GROW, AG** (accumulated gradient, Alg. 2) — over the γ steps ending at a reselection (the
  *gradient-estimation window*) the dense gradient of each targeted matrix is formed transiently.
  On the window's first micro-batch the top-K_i positions by |∂L/∂θ| become *candidates*
  (K_i = ⌈candidate_ratio · d_φ(i)⌉); from then on only their gradients are kept: per optimizer
  step their sum g (the gradient Adam sees), accumulated as Σg and Σg² over the window (Eq. 7.5).
  Grow the k eligible candidates (not among the kept ones) with the largest |ĝ| = |Σg|/γ (by default
  divided by the column's RMS gradient: ``score_normalization``). If fewer than k are eligible, drop only
  as many as can be grown.
* **GROW, MA** (momentum approximation, Alg. 3) — the k positions outside the kept ones with the largest
  √⁴(R_i·C_j) (Eq. 7.7) from SM3's row/column accumulators (SM3's own; beside another optimizer the
  scheduler keeps the same accumulators from each step's gradients). The scores form a rank-one matrix, so
  a threshold that leaves about d_φ positions above it is found by counting, and only those
  positions are listed and ranked: no (out, in) score matrix exists.

The algorithms leave open what happens to a weight dropped and grown at the same reselection; here it
comes back as a new weight. ``reference="authors"`` runs the authors' released rules instead (AG keeps it
in place with its value and Adam state, MA never grows it) together with the released budget, k(t),
windows and seeding: ``docs/differences.md`` lists every difference.

The scheduler reselects all tensors together (:func:`reselect_all`): each tensor's drop and AG grow
is a rank within its segment of one concatenation, so a reselection costs a handful of launches
whatever the number of tensors; :func:`reselect_ag` and :func:`reselect_ma` are the same policy for
one tensor, written plainly (and the reference the batched version is tested against).

Grown weights start at φ = 0 with age t; the optimizer keeps the same Parameter objects and its
state is re-gathered and seeded by :mod:`peft_sparse.optim.surgery`. Persistent memory is O(d_φ):
candidate statistics exist only during windows, the dense gradient only inside a backward pass.

The package reads top to bottom: :mod:`.config` (the fields), :mod:`.scheduler` (when a reselection
happens: the loop and its windows), :mod:`.reselect` (what one reselection edits), :mod:`.checks` (what is
refused before a run), :mod:`.statistics` (the AG estimation window; MA's accumulators beside a non-SM3
optimizer and its ``ma_signal='io'`` window), :mod:`.selection` (DROP and GROW for one tensor, Algorithms 2–3),
:mod:`.batched` (the same for all tensors at once, the path the scheduler takes), :mod:`.adaptive`
(``budget_split="adaptive"``: one drop/grow over all tensors), :mod:`.rank_one` (MA's top-k of R_i·C_j without
the score matrix), :mod:`.seeding` (Adam moments of grown slots), :mod:`.state` (save and resume) and
:mod:`.model` (the PEFT tuner, and the released budget rule).
"""

from .config import SpIELConfig
from .model import SpIELModel
from .scheduler import SpIELScheduler

__all__ = ["SpIELConfig", "SpIELModel", "SpIELScheduler"]
