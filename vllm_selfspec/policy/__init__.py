"""How drafting is decided: each round's budgets (`rounds.py`), what a draft
pays (`payoff.py`), DEL's exit statistics and SWIFT's skip-set search, each
tested through its own API. The round policy and the payoff import neither
torch nor vLLM."""
