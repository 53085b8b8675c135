"""One prompt's holdings across the cluster (`Holdings`: the KV index's answer to a lookup),
laid out for the routing searches of kv_scoring.py.

A lookup at 128 replicas finds a few replicas holding the conversation and, often, dozens
holding only a shared system prompt. Those dozens differ in load only, and a search needs the
least loaded few of them. So the answer does not name them: a group of more than SMALL_GROUP
holders is a bit mask, and searches walk the load board (every replica by `load_key`, least
first, with its bit) taking the members of each group as they come. Building a Holding per
holder and sorting big groups by load took most of a lookup (`pdserve bench router-sim`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from deployments.cluster.kv_cost import DEFAULT_WEIGHTS, Holding, RoutingWeights, load_key

# Holders of one (cached_blocks, tier_blocks) are named and evaluated one by one up to this
# many; a bigger group (everyone holding a shared system prompt) is walked by load.
SMALL_GROUP = 4


class HeldGroup(NamedTuple):
    """Replicas holding the same of a prompt (they cost alike, at equal load)."""

    cached_blocks: int
    tier_blocks: int  # of cached_blocks, those in a tier below the pool only
    mask: int  # the members' bits (`Holdings.bits`)
    members: tuple[str, ...]  # named for a small group; () for a big one (walked by `mask`)


# (load_key, replica, bit), least first: every replica of an answer, as searches walk them.
Board = tuple[tuple[float, str, int], ...]


class Holdings(Mapping[str, Holding]):
    """Every replica's holding of one prompt: a mapping, laid out for the searches.

    `replicas`: every replica of the answer holding none of it (the index keeps these as
    loads arrive); `groups`: the holders, by what they hold; `board`: every replica by load;
    `bits`: each replica's bit in the groups' masks (the index's numbering; it may name
    replicas of another role, which `known` leaves out). A holder's Holding is made when asked
    for, except a small group's (`held`), which searches evaluate one by one."""

    def __init__(
        self,
        replicas: dict[str, Holding],
        groups: tuple[HeldGroup, ...],
        board: Board,
        bits: Mapping[str, int],
        known: int,
        roles: Mapping[str, tuple[int, Board]],
        held: dict[str, Holding],
        request_tokens: float = DEFAULT_WEIGHTS.request_tokens,
    ) -> None:
        self.replicas, self.groups, self.board, self.bits = replicas, groups, board, bits
        self.known = known  # the bits of `replicas` (the C searches take one for the other)
        self.roles = roles  # per role: the bits of its replicas, and their board
        self.request_tokens = request_tokens  # the weight the board's keys were taken with
        self.weights = (  # weights of that request_tokens (their load_key is the board's)
            DEFAULT_WEIGHTS
            if request_tokens == DEFAULT_WEIGHTS.request_tokens
            else RoutingWeights(request_tokens=request_tokens)
        )
        self._held = held
        self.big = tuple(g for g in groups if not g.members)
        self.held_mask = self.small_mask = 0
        for group in groups:
            self.held_mask |= group.mask
            if group.members:
                self.small_mask |= group.mask

    @classmethod
    def of(cls, holdings: Mapping[str, Holding], request_tokens: float) -> Holdings:
        """A plain mapping's holdings, laid out (bits in its order)."""
        bits = {replica: 1 << i for i, replica in enumerate(holdings)}
        weights = RoutingWeights(request_tokens=request_tokens)
        board = tuple(sorted((load_key(h.load, weights), r, bits[r]) for r, h in holdings.items()))
        replicas: dict[str, Holding] = {}
        alike: dict[tuple[int, int], list[str]] = {}
        for replica, h in holdings.items():
            replicas[replica] = h._replace(cached_blocks=0, tier_blocks=0)
            if h.cached_blocks:
                alike.setdefault((h.cached_blocks, h.tier_blocks), []).append(replica)
        roles: dict[str, tuple[int, Board]] = {}
        for role in {h.role for h in holdings.values()} - {""}:  # ("": not announced)
            mask = sum(bits[r] for r, h in holdings.items() if h.role == role)
            roles[role] = (mask, tuple(entry for entry in board if entry[2] & mask))
        groups: list[HeldGroup] = []
        held: dict[str, Holding] = {}
        for (blocks, tier), members in alike.items():
            small = len(members) <= SMALL_GROUP
            mask = sum(bits[r] for r in members)
            groups.append(HeldGroup(blocks, tier, mask, tuple(members) if small else ()))
            held.update((r, holdings[r]) for r in members if small)
        known = (1 << len(bits)) - 1
        return cls(replicas, tuple(groups), board, bits, known, roles, held, request_tokens)

    def __getitem__(self, replica: str) -> Holding:
        holding = self._held.get(replica)
        if holding is not None:
            return holding
        idle = self.replicas[replica]
        bit = self.bits.get(replica, 0)
        for group in self.big:
            if bit & group.mask:
                blocks, tier = group.cached_blocks, group.tier_blocks
                return Holding(blocks, idle.load, idle.role, idle.side_channel, tier)
        return idle

    def __iter__(self) -> Iterator[str]:
        return iter(self.replicas)

    def __len__(self) -> int:
        return len(self.replicas)

    def __contains__(self, replica: object) -> bool:
        return replica in self.replicas

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray's actor boundary
        parts = (self.replicas, self.groups, self.board, self.bits, self.known, self.roles)
        return (Holdings, (*parts, self._held, self.request_tokens))

    def role_of(self) -> dict[str, str]:
        """Each replica's role."""
        return {replica: holding.role for replica, holding in self.replicas.items()}

    def role_mask(self, role: str | None) -> int:
        """The bits of the replicas of `role` (of every one for None; "" is no role: a
        replica that has not announced one is of none)."""
        return self.known if role is None else self.roles.get(role, (0, ()))[0]

    def board_of(self, eligible: int) -> Board:
        """The board to walk for the `eligible` replicas: their role's where they have one."""
        for mask, board in self.roles.values():
            if not eligible & ~mask:
                return board
        return self.board

    def members_in(self, group: HeldGroup, mask: int) -> list[str]:
        """A small group's members of `mask`."""
        bits = self.bits
        return [r for r in group.members if bits[r] & mask]

    def members(self, group: HeldGroup) -> tuple[str, ...]:
        """A group's members: a big one's least loaded first (by the board)."""
        mask = group.mask
        return group.members or tuple(r for _, r, bit in self.board if bit & mask)


def as_holdings(holdings: Mapping[str, Holding], weights: RoutingWeights) -> Holdings:
    """`holdings` laid out for the searches (a plain mapping's worked out once)."""
    if isinstance(holdings, Holdings) and holdings.request_tokens == weights.request_tokens:
        return holdings
    return Holdings.of(holdings, weights.request_tokens)
