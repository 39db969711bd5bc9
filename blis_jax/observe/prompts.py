"""Prompt text (spec §4): token IDs → words of a fixed 100-word vocabulary, scaled by the
tokens-per-word ratio the probe measured, plus one seeded word sequence per prefix group.

Words rather than token IDs because a server tokenizes text: diverse words give a realistic
token count per word (~1.5–1.7 with BPE) that the probe measures, so a prompt of
Round(L / ratio) words is about L server tokens. Group members share their leading text
exactly, so the server's prefix cache can hit it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence


from blis_jax.rng.go_rand import GoRand
from blis_jax.rng.streams import fnv1a64

# BLIS cmd/observe_cmd.go: the NATO alphabet, then 74 plant, spice and nature words.
VOCABULARY: tuple[str, ...] = tuple("""
alpha bravo charlie delta echo foxtrot golf hotel india juliet
kilo lima mike november oscar papa quebec romeo sierra tango
uniform victor whiskey xray yankee zulu apple banana cherry date
elder fig grape hazel iris jasmine kiwi lemon mango nutmeg
olive peach quince rose sage thyme umber violet willow yarrow
acorn birch cedar daisy elm fern ginger holly ivy juniper
kelp laurel maple nettle oak pine quinoa reed spruce tulip
umbra vine walnut xylem yew zinnia alder basil clover dill
fennel garlic hemp indigo jade kumquat lily moss neem orchid
poppy rye saffron tea urchin verbena wheat xeris yucca zest
""".split())
assert len(VOCABULARY) == 100 and len(set(VOCABULARY)) == 100

PROBE_PROMPT = " ".join(VOCABULARY)  # the calibration probe: all words once, no trailing space
DEFAULT_PREFIX_LENGTH = 50  # a client naming a group without prefix_length

# A word-index stream for a prefix group: (group seed, count) → `count` indices in [0, 100).
WordDraws = Callable[[int, int], Sequence[int]]


def go_round(x: float) -> int:
    """Go's math.Round for the non-negative values here: halves away from zero."""
    return int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))


def words(tokens: Sequence[int], n: int) -> str:
    """n words, each followed by one space: word i is V[tokens[i] mod 100], or V[i mod 100] past
    the end of `tokens` (spec §4.2)."""
    m = len(tokens)
    return "".join(VOCABULARY[(int(tokens[i]) if i < m else i) % 100] + " " for i in range(n))


def word_count(tokens: int, ratio: float) -> int:
    """max(1, Round(tokens / ratio)); a ratio ≤ 0 counts as 1."""
    return max(1, go_round(tokens / (ratio if ratio > 0 else 1.0)))


def group_seed(seed: int, group: str) -> int:
    """64-bit FNV-1a over the seed's 8 little-endian bytes and the group name, as int64."""
    return fnv1a64((seed & ((1 << 64) - 1)).to_bytes(8, "little") + group.encode())


def go_word_draws(seed: int, count: int) -> list[int]:
    """BLIS's draws: `Intn(100)` from a Go math/rand source seeded with the group seed."""
    src = GoRand(seed)
    return [src.intn(100) for _ in range(count)]


def prefix_string(seed: int, group: str, prefix_tokens: int, ratio: float,
                  draws: WordDraws = go_word_draws) -> str:
    """The shared leading text of a prefix group (spec §4.5)."""
    n = word_count(prefix_tokens, ratio)
    return "".join(VOCABULARY[i] + " " for i in draws(group_seed(seed, group), n))


class PromptBuilder:
    """Prompt of a request from its token IDs, with the run's ratio and prefix strings."""

    def __init__(self, ratio: float, prefix_strings: Mapping[str, tuple[str, int]] | None = None) -> None:
        self.ratio = ratio if ratio > 0 else 1.0
        self.prefix_strings = dict(prefix_strings or {})  # group → (text, target prefix tokens)

    def build(self, token_ids: Sequence[int], input_len: int, prefix_group: str = "") -> str:
        entry = self.prefix_strings.get(prefix_group) if prefix_group else None
        if entry is None:
            return words(token_ids, word_count(input_len, self.ratio))
        text, target = entry
        suffix = max(1, input_len - target)
        return text + words(token_ids[len(token_ids) - suffix:] if suffix <= len(token_ids) else token_ids,
                            word_count(suffix, self.ratio))


def group_prefix_lengths(clients: Sequence[tuple[str, int]]) -> dict[str, int]:
    """Group → prefix target length from (group, prefix_length) per client in spec order: the
    last client naming a group wins, ≤ 0 means 50 (BLIS's rule)."""
    out: dict[str, int] = {}
    for group, length in clients:
        if group:
            out[group] = length if length > 0 else DEFAULT_PREFIX_LENGTH
    return out


def build_prefix_strings(seed: int, lengths: Mapping[str, int], ratio: float,
                         draws: WordDraws = go_word_draws) -> dict[str, tuple[str, int]]:
    return {g: (prefix_string(seed, g, p, ratio, draws), p) for g, p in lengths.items()}
