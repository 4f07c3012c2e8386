"""Choosing on the valid set (dsmt.selection): a candidate replaces the default only by a gain larger than the
valid set's noise, and every candidate is reported with its length ratio."""

from dsmt.selection import SIGNIFICANCE, choose

SENTENCES = ["A cat sits on the red mat today.", "Two dogs run in the green park.", "The man rides a bike.",
             "A woman in a blue dress sings.", "Children play football on the beach."]
REFERENCES = [f"{s[:-1]} number {i}." for i, s in enumerate(SENTENCES * 60)]
DEFAULT = [r.replace("red", "blue").replace("dogs", "cats") for r in REFERENCES]


def test_a_clear_gain_is_chosen():
    better = [r.replace("red", "blue") for r in REFERENCES]  # fixes every "dogs" line: 60 of 300
    chosen, scored = choose({"default": DEFAULT, "better": better}, REFERENCES, "default")
    assert chosen == "better"
    assert scored["better"].bleu > scored["default"].bleu and scored["better"].p_value < SIGNIFICANCE
    assert scored["default"].p_value is None


def test_a_gain_within_the_noise_keeps_the_default():
    """One sentence of 300 fixed: the candidate's BLEU is higher, as the best of several would be by chance."""
    lucky = list(DEFAULT)
    lucky[1] = REFERENCES[1]
    chosen, scored = choose({"default": DEFAULT, "lucky": lucky}, REFERENCES, "default")
    assert scored["lucky"].bleu > scored["default"].bleu
    assert chosen == "default" and scored["lucky"].p_value >= SIGNIFICANCE


def test_the_best_significant_candidate_wins_and_length_ratios_are_reported():
    most = [f if i % 10 == 0 else r for i, (r, f) in enumerate(zip(REFERENCES, DEFAULT))]  # a tenth left wrong
    longer = [r.replace("today", "today again and again") for r in REFERENCES]
    candidates = {"default": DEFAULT, "perfect": REFERENCES, "most": most, "longer": longer}
    chosen, scored = choose(candidates, REFERENCES, "default")
    assert scored["most"].p_value < SIGNIFICANCE and scored["perfect"].bleu > scored["most"].bleu
    assert chosen == "perfect" and scored["perfect"].length_ratio == 1.0
    assert scored["longer"].length_ratio > 1.0 == scored["default"].length_ratio
    assert choose(candidates, REFERENCES, "default") == (chosen, scored)  # the resampling is seeded
