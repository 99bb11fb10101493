"""The algorithm in plain torch: sorted draft, verification, sampling, KV rollback, policies, the engine loop.

Nothing in this package imports Ray or pydantic (a test enforces it), so the same code runs in-process, in the CLI,
in benchmarks and inside Ray Serve deployments.
"""
