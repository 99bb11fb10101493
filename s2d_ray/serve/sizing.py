"""How many sequences a target's replica can hold: KV rows from the model's shapes and the memory it has.

The schema (serve/app_config.py) says what was configured; this says what fits: a target's memory is its device's
(`device_memory_gib`) or, on the CPU, the host's RAM, and with `memory_fraction` its KV rows are what that share holds
after the weights (models/capacity.py). `TargetSizing` and `AppSizing` are mixed into `TargetSpec` and `AppConfig`,
which validate with them (`check_memory`) and serve them to the replicas and routers.
"""

from __future__ import annotations

from typing import Any

from ..config import context_window
from ..hardware import resolve_dtype
from ..models.capacity import GIB, Capacity, ModelShape, check_prefix_budget, host_memory_bytes, kv_capacity, \
    read_model_config


class TargetSizing:
    """A target's memory and KV rows (mixed into `TargetSpec`, whose fields it reads)."""

    def memory_bytes(self) -> int | None:
        """The memory `memory_fraction` takes a share of, where known before the replica starts."""
        if self.device_memory_gib is not None:
            return int(self.device_memory_gib * GIB)
        return host_memory_bytes() if self.device == "cpu" else None

    def capacity(self, config: dict[str, Any], max_slots: int, memory_bytes: int, weight_bytes: int | None = None,
                 ) -> Capacity:
        """KV rows of `max_slots` positions this target's replica (each rank) holds in its memory budget; the
        weights estimated from the model's shapes unless measured (`weight_bytes`)."""
        shape, dtype = ModelShape.from_config(config), resolve_dtype(self.dtype, self.device)
        weights = weight_bytes if weight_bytes is not None else shape.weight_bytes(dtype, self.tp_size)
        return kv_capacity(int(memory_bytes * (self.memory_fraction or 1.0)), weights,
                           shape.kv_bytes_per_token(dtype, self.tp_size), max_slots, self.max_live_sequences,
                           f"target {self.name}")


class AppSizing:
    """Rows per target across the app (mixed into `AppConfig`, whose fields it reads)."""

    def max_sequences(self, name: str) -> int:
        """Sequences a router decodes together for a target: at most the KV rows a replica keeps (max_live_sequences,
        and with `memory_fraction` what fits); the rest queue instead of evicting each other or running out of
        memory."""
        spec = self.target(name)
        configured = min(spec.max_concurrent_sequences or self.limits.max_concurrent_sequences, spec.max_live_sequences)
        capacity = self.target_capacity(name)
        return configured if capacity is None else min(configured, capacity.rows)

    def target_window(self, name: str, config: dict[str, Any]) -> int:
        """Longest sequence admitted for a target (config: its model's config.json): config.context_window, capped by
        limits.max_total_tokens; the most slots a replica's cache ever needs for it."""
        return context_window(self.target(name).max_context, config, self.limits.max_total_tokens)

    def _prefix_budget_fits(self, spec: TargetSizing) -> None:
        """A prefix_cache.max_tokens given in the config within the target's memory (its share with memory_fraction),
        where known here. The default is not checked: kept rows give way to live ones, so a small replica keeps less."""
        if not self.prefix_cache.enabled or "max_tokens" not in self.prefix_cache.model_fields_set:
            return
        memory, config = spec.memory_bytes(), read_model_config(spec.resolved_source, self.cache_dir, resolve=False)
        if memory is None or config is None:
            return
        shape, dtype = ModelShape.from_config(config), resolve_dtype(spec.dtype, spec.device)
        check_prefix_budget(self.prefix_cache.max_tokens, int(memory * (spec.memory_fraction or 1.0)),
                            shape.weight_bytes(dtype, spec.tp_size), shape.kv_bytes_per_token(dtype, spec.tp_size),
                            f"target {spec.name}")

    def target_capacity(self, name: str, resolve: bool = True) -> Capacity | None:
        """The target's memory-based sizing where it can be computed here (None: no memory_fraction, or the device's
        memory or the model's config is not known here); `resolve=False` reads local model directories only."""
        spec = self.target(name)
        memory = spec.memory_bytes()
        if spec.memory_fraction is None or memory is None:
            return None
        config = read_model_config(spec.resolved_source, self.cache_dir, resolve=resolve)
        if config is None:
            return None
        return spec.capacity(config, self.target_window(name, config), memory)

    def check_memory(self) -> None:
        """Raise when not even one full-length row of a target fits, or a configured prefix budget does not."""
        for t in self.targets:
            self.target_capacity(t.name, resolve=False)
            self._prefix_budget_fits(t)
