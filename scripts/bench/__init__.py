"""The benchmarks as a package: `presets` (the configs compared), `workload`
(the prompts), `machine` (drift probe and run orders), `runner` (engines and
measurement), `report` (rows, table, reading), `plots` and `experiments`
(the papers' sweeps). `scripts/benchmark.py` is the command line over them;
`scripts/serve_sweep.py` shares the presets."""
