"""The one pick-and-margin rule (``ficco_select.runtime.decision.pick_with_margin``), shared
by the runtime selector, evaluation, abstention fitting and ``ficco adapt``."""

import numpy as np
import pandas as pd

from ficco_select.runtime.decision import SINGLE_CANDIDATE_MARGIN, pick_with_margin
from ficco_select.train.selectors import _argmin_choice


def test_the_lowest_score_is_picked_and_its_margin_is_the_gap_to_the_second():
    at, margin = pick_with_margin(np.array([0.5, 0.2, 0.35]), np.array(["a", "b", "c"]))
    assert at.tolist() == [1] and np.allclose(margin, [0.15])


def test_a_tie_goes_to_the_first_name_whatever_the_row_order():
    for names in (["ring.sm", "none.sm", "shard.sm"], ["shard.sm", "none.sm", "ring.sm"]):
        scores = np.array([0.1 if n != "shard.sm" else 0.3 for n in names])
        at, margin = pick_with_margin(scores, np.array(names))
        assert names[at[0]] == "none.sm" and margin.tolist() == [0.0]


def test_a_lone_candidate_has_the_single_candidate_margin():
    at, margin = pick_with_margin(np.array([3.0]), np.array(["none.sm"]))
    assert at.tolist() == [0] and margin.tolist() == [SINGLE_CANDIDATE_MARGIN]


def test_many_scenarios_at_once_equal_one_at_a_time_in_order_of_first_appearance():
    rng = np.random.default_rng(0)
    groups = rng.choice(["s3", "s1", "s2", "s0"], size=200)
    scores = rng.integers(0, 4, size=200) / 4  # many exact ties
    names = rng.choice(["a", "b", "c", "d", "e"], size=200)
    at, margin = pick_with_margin(scores, names, groups)
    order = list(dict.fromkeys(groups))
    assert groups[at].tolist() == order
    for g, i, mg in zip(order, at, margin):
        rows = np.flatnonzero(groups == g)
        (j,), (m,) = pick_with_margin(scores[rows], names[rows])
        assert rows[j] == i and m == mg


def test_evaluation_picks_by_the_same_rule():
    ok = pd.DataFrame({"scenario_id": ["x", "x", "y", "y", "y"],
                       "schedule": ["shard.ring.sm", "none.sm", "none.sm", "shard.ring.sm", "ficco.d2.ring.sm"]})
    assert _argmin_choice(ok, np.array([0.0, 0.0, 1.0, 0.5, 0.5])) == {"x": "none.sm", "y": "ficco.d2.ring.sm"}
