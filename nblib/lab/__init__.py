"""One module per notebook: its demos, reference comparisons and projections (narrative lives here).

Core packages (cache, store, encode, shuffle, budget, ...) stay reusable and free of narrative;
what a single notebook shows, compares or concludes lives in its `lab` module. Verdicts are
computed from tolerances, never typed.
"""
