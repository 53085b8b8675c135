"""What the scheduler's side of a KV tier asks its worker to copy, and what comes back.

One ordered list of copies per step, run by the worker one after another: a slot is never
rewritten before an earlier load from it has read it, nor read before the store that fills it
has written it, so the scheduler may reuse a slot the moment it decides to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class TierCopy(NamedTuple):
    """One block between the primary pool and a tier slot. A store (`load_of` empty) copies
    block -> slot; a load copies slot -> block for request `load_of`, and `last` marks its
    request's last block. `version` is the slot's (TierIndex counts its reuses), so a failed
    load drops the entry it read, not whatever the slot holds by the time that is known.
    A demotion (`from_slot` set; no block) moves a slot of one tier to a slot of the tier
    below, with the sum the block left the pool with (if `from_version` is still the
    source's): a load from the lower tier is checked against that same sum."""

    block_id: int
    slot: int
    version: int
    load_of: str = ""
    last: bool = False
    # A store whose block is held until the copy is done (reported in `stored`); an unheld
    # one (a preempted request's: its blocks are needed now) is made before the step runs.
    held: bool = True
    from_slot: int = -1
    from_version: int = 0


@dataclass
class TierReport:
    """The worker's copies that ended since its last report (in their order)."""

    num_done: int = 0  # copies of any kind
    stored: list[int] = field(default_factory=list)  # held blocks whose stores are done
    loaded: set[str] = field(default_factory=set)  # requests whose every load is done
    num_loaded: int = 0  # blocks loaded and verified
    invalid_block_ids: set[int] = field(default_factory=set)  # loads that did not verify
    bad_slots: list[tuple[int, int]] = field(default_factory=list)  # (slot, version) read bad
    copy_us: int = 0  # spent copying and summing
    bytes_copied: int = 0

    def add(self, later: TierReport) -> None:
        """Take in a later report (the worker's batches, before the scheduler asks)."""
        self.num_done += later.num_done
        self.stored.extend(later.stored)
        self.loaded |= later.loaded
        self.num_loaded += later.num_loaded
        self.invalid_block_ids |= later.invalid_block_ids
        self.bad_slots.extend(later.bad_slots)
        self.copy_us += later.copy_us
        self.bytes_copied += later.bytes_copied
