"""Go `math/rand` v1 source (Int63 / Int31n), for the words of observe's prefix strings.

The algorithm is Go's additive lagged-Fibonacci generator (../shared/reference/go-math-rand
README). Its 607 "cooked" constants are data, not algorithm: the caller passes them (the
project's Go-compatible RNG module, or the reference `tables.json` in tests). Without them
observe falls back to a NumPy stream, which gives different (equally shared) prefix words.
"""

from __future__ import annotations

from collections.abc import Sequence

_LEN, _TAP = 607, 273
_M = (1 << 31) - 1
_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def _seedrand(x: int) -> int:
    """One step of the 31-bit Lehmer generator x ← 48271·x mod (2³¹−1) (Go's Schrage form)."""
    hi, lo = divmod(x, 44488)
    x = 48271 * lo - 3399 * hi
    return x + _M if x < 0 else x


class GoSource:
    """`rand.New(rand.NewSource(seed))` with the methods observe needs."""

    def __init__(self, seed: int, cooked: Sequence[int]) -> None:
        if len(cooked) != _LEN:
            raise ValueError(f"cooked table: {len(cooked)} values, expected {_LEN}")
        self._tap, self._feed = 0, _LEN - _TAP
        seed %= _M  # Go: seed = seed % int32max, then negative → + int32max
        if seed < 0:
            seed += _M
        if seed == 0:
            seed = 89482311
        x = seed
        vec = [0] * _LEN
        for i in range(-20, _LEN):
            x = _seedrand(x)
            if i >= 0:
                u = x << 40
                x = _seedrand(x)
                u ^= x << 20
                x = _seedrand(x)
                u ^= x
                vec[i] = (u ^ cooked[i]) & _MASK64
        self._vec = vec

    def uint64(self) -> int:
        self._tap = self._tap - 1 if self._tap > 0 else _LEN - 1
        self._feed = self._feed - 1 if self._feed > 0 else _LEN - 1
        x = (self._vec[self._feed] + self._vec[self._tap]) & _MASK64
        self._vec[self._feed] = x
        return x

    def int63(self) -> int:
        return self.uint64() & _MASK63

    def int31(self) -> int:
        return self.int63() >> 32

    def int31n(self, n: int) -> int:
        if n & (n - 1) == 0:
            return self.int31() & (n - 1)
        limit = (1 << 31) - 1 - (1 << 31) % n
        v = self.int31()
        while v > limit:
            v = self.int31()
        return v % n

    def intn(self, n: int) -> int:
        """Go `Intn` for n < 2³¹ (the only case observe uses): `Int31n`."""
        return self.int31n(n)
