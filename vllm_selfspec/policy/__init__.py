"""How drafting is decided: each round's budgets (`rounds.py`), what a draft
pays (`payoff.py`), when a request's drafts stop (`confidence_stop.py`),
whether a method's mechanism beats the full-depth draft (`mechanism_gate.py`),
DEL's exit statistics, AdaDecode's exit gate and SWIFT's skip-set search, each
tested through its own API. None of it imports torch or vLLM."""
