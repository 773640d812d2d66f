"""Everything that touches vLLM's internals: the patch list (`integration/patches.py`),
the runner and engine hooks it installs, token-source accounting, Ray on
the CPU, the frame stack and the CPU build's fixes."""
