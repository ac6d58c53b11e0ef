"""kvd.integrations.paged: a paged KV cache's blocks, handed off between inference engine instances
of any TP x PP layout (engine worker and scheduler processes; engine-agnostic: no engine import).

Modules: handoff (what a worker saves and loads, with a client), layout (what an entry holds and
which entries a consumer rank reads: pure), groups (which blocks of each KV cache group move: pure).
The vLLM connector (`kvd.integrations.vllm`) is a thin adapter over them.
"""
