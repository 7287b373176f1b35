"""Per-layer storage, by the names earlier releases exported: the sliding-window rings (`ring.py`), the exact
full-attention buffers (`full.py`) and their shared base (`storage.py`)."""

from .errors import CacheCapacityError, RollbackError
from .full import GrowableFullLayer, StaticFullLayer
from .ring import RingSlidingLayer, StaticRingSlidingLayer
from .storage import GROWTH_FACTOR, NOTHING_WRITTEN, grown_capacity, prepare_fixed_capacity_step

__all__ = [
    "GROWTH_FACTOR",
    "NOTHING_WRITTEN",
    "CacheCapacityError",
    "GrowableFullLayer",
    "RingSlidingLayer",
    "RollbackError",
    "StaticFullLayer",
    "StaticRingSlidingLayer",
    "grown_capacity",
    "prepare_fixed_capacity_step",
]
