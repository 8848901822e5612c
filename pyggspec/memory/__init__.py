"""Per-sequence model memory: attention KV caches and gated-delta-net states."""

from pyggspec.memory.kv import KVCache
from pyggspec.memory.recurrent import RecurrentState
from pyggspec.memory.slots import Checkpoint, SlotMemory

__all__ = ["Checkpoint", "KVCache", "RecurrentState", "SlotMemory"]
