"""Go's `math/rand` v1 generator (`rand.New(rand.NewSource(seed))`), bit for bit.

BLIS draws every random number from this generator (blis-rng.md), so reproducing BLIS's seeded
workloads needs its exact streams. The source is an additive lagged-Fibonacci generator over
64-bit words, y[k] = y[k−607] + y[k−273] (mod 2⁶⁴), seeded by a 31-bit Lehmer generator XOR
Go's constant table. Every method consumes whole 64-bit outputs in sequence, so the output
sequence does not depend on which methods consume it: `GoRand` computes it ahead in numpy
blocks of up to 273 words (the short lag: within a block no word depends on another) and hands
out words from a cursor. Token-ID blocks (`Intn(128000)` with its rejection step, blis-rng.md
§3.1) are drawn vectorized from that buffer.

`NormFloat64`/`ExpFloat64` are Go's ziggurats with float32 tables and float32 comparisons;
their tails use `go_log`, a transcription of Go's `math.Log` (it differs from libm's `log` in
the last bit for ~7 % of arguments, and tail values carry it into the sample).
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from blis_jax.rng import _go_tables as _t

LEN = 607                      # register length (long lag)
TAP = 273                      # short lag
_INT32_MAX = (1 << 31) - 1
_MASK63 = (1 << 63) - 1
_TWO63 = float(1 << 63)
_SEED_ZERO = 89482311          # Go's replacement for a seed ≡ 0 (mod 2³¹−1)
_FIRST_CHUNK = 2 * TAP
_MAX_CHUNK = 1 << 18

_COOKED = np.array(_t.RNG_COOKED, dtype=np.int64).view(np.uint64)
_KN = _t.KN
_WN = [float(np.float32(s)) for s in _t.WN]
_FN = [np.float32(s) for s in _t.FN]
_KE = _t.KE
_WE = [float(np.float32(s)) for s in _t.WE]
_FE = [np.float32(s) for s in _t.FE]
_RN = 3.442619855899
_RN_INV = 1.0 / 3.442619855899          # Go multiplies by this constant (blis-rng.md §1 item 1)
_RE = 7.69711747013104972

# Go math.Log (FreeBSD e_log) constants.
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_L1 = 6.666666666666735130e-01
_L2 = 3.999999999940941908e-01
_L3 = 2.857142874366239149e-01
_L4 = 2.222219843214978396e-01
_L5 = 1.818357216161805012e-01
_L6 = 1.531383769920937332e-01
_L7 = 1.479819860511658591e-01
_SQRT2_HALF = 1.41421356237309504880168872420969808 / 2

TOKEN_VOCAB = 128000           # BLIS token IDs: Intn(128000)
# Token IDs one stream may draw (~1-2 min at the measured 2-10e7 draws/s). BLIS draws an ID for
# every prompt and output token, so a larger workload cannot be reproduced in reasonable time
# (a trillion-token prompt would never finish): it is refused before drawing.
MAX_TOKEN_DRAWS = 1 << 32
# Int31n(128000) rejects Int31 values above this (2³¹−1 − 2³¹ mod 128000).
_TOKEN_MAX = _INT32_MAX - (1 << 31) % TOKEN_VOCAB
_TOKEN_REJECT_SHIFTED = np.uint64((_TOKEN_MAX + 1) << 33)


def go_log(x: float) -> float:
    """Go's `math.Log` (bit-exact for finite x > 0; Log(0) = −Inf)."""
    if x != x or x == math.inf:
        return x
    if x < 0:
        return math.nan
    if x == 0:
        return -math.inf
    f1, ki = math.frexp(x)
    if f1 < _SQRT2_HALF:
        f1 *= 2
        ki -= 1
    f = f1 - 1
    k = float(ki)
    s = f / (2 + f)
    s2 = s * s
    s4 = s2 * s2
    t1 = s2 * (_L1 + s4 * (_L3 + s4 * (_L5 + s4 * _L7)))
    t2 = s4 * (_L2 + s4 * (_L4 + s4 * _L6))
    r = t1 + t2
    hfsq = 0.5 * f * f
    return k * _LN2_HI - ((hfsq - (s * (hfsq + r) + k * _LN2_LO)) - f)


def go_round(x: float) -> float:
    """Go's `math.Round`: nearest integer, ties away from zero."""
    if not math.isfinite(x):
        return x
    t = float(math.trunc(x))
    if abs(x - t) >= 0.5:
        t += math.copysign(1.0, x)
    return t


def _lehmer_powers() -> np.ndarray:
    """48271^k mod (2³¹−1) for k = 1 … 20 + 3·607: the seeding sequence is x0·A[k] mod m."""
    out, x = [], 1
    for _ in range(20 + 3 * LEN):
        x = x * 48271 % _INT32_MAX
        out.append(x)
    return np.array(out, dtype=np.int64)


_POWERS = _lehmer_powers()


def _seed_register(seed: int) -> np.ndarray:
    """Go's `rngSource.Seed`: the 607-word register (index order) of a fresh source."""
    x = seed % _INT32_MAX          # Python's floor mod equals Go's `%` followed by "+m if < 0"
    if x == 0:
        x = _SEED_ZERO
    # Go steps x ← 48271·x mod (2³¹−1) 20 times, then three times per slot; every x is
    # x0·48271^k mod m, and x0·A[k] < 2⁶² fits in int64.
    xs = ((np.int64(x) * _POWERS[20:]) % _INT32_MAX).astype(np.uint64).reshape(LEN, 3)
    u = (xs[:, 0] << np.uint64(40)) ^ (xs[:, 1] << np.uint64(20)) ^ xs[:, 2]
    return u ^ _COOKED


def _extend(history: np.ndarray, n: int) -> np.ndarray:
    """The n outputs following `history` (the last 607 outputs, oldest first)."""
    buf = np.empty(LEN + n, dtype=np.uint64)
    buf[:LEN] = history
    end = LEN + n
    for s in range(LEN, end, TAP):
        e = min(s + TAP, end)
        np.add(buf[s - LEN:e - LEN], buf[s - TAP:e - TAP], out=buf[s:e])
    return buf[LEN:]


class GoRand:
    """`rand.New(rand.NewSource(seed))` of Go's math/rand v1.

    Methods carry Go's names in snake case (`int63`, `intn`, `float64`, `norm_float64`, ...).
    `tokens(n)` / `skip_tokens(n)` draw n `Intn(128000)` values in one vectorized step.
    """

    __slots__ = ("_arr", "_list", "_pos", "_tail", "_hist", "_next", "_bad", "drawn")

    def __init__(self, seed: int):
        reg = _seed_register(int(seed))
        # Fresh source: tap = 0, feed = 334; output k updates index (333 − k) mod 607 with
        # index (606 − k) mod 607, so the "previous outputs" y[−j] = reg[(333 + j) mod 607].
        j = np.arange(LEN, 0, -1)
        self._tail = reg[(LEN - TAP - 1 + j) % LEN]
        self._hist = self._tail        # the last 607 words consumed (for `register`)
        self._arr = np.zeros(0, dtype=np.uint64)
        self._list: list[int] | None = []
        self._pos = 0
        self._bad: list[int] = []
        self._next = _FIRST_CHUNK
        self.drawn = 0                  # 64-bit outputs consumed so far

    # ------------------------------------------------------------------ the word stream

    def _refill(self, need: int) -> None:
        """Ensure at least `need` unconsumed words are buffered."""
        pos = self._pos
        left = self._arr[pos:]
        if left.shape[0] >= need:
            return
        n = max(need - left.shape[0], self._next)
        self._next = min(2 * self._next, _MAX_CHUNK)
        new = _extend(self._tail, n)
        self._tail = new[-LEN:] if n >= LEN else np.concatenate([self._tail, new])[-LEN:]
        self._hist = np.concatenate([self._hist, self._arr[max(0, pos - LEN):pos]])[-LEN:]
        # Int31 > _TOKEN_MAX ⇔ the low 63 bits ≥ (_TOKEN_MAX + 1)·2³² (shifting left drops bit 63)
        bad_new = np.flatnonzero((new << np.uint64(1)) >= _TOKEN_REJECT_SHIFTED)
        # Positions of words an Intn(128000) draw would reject (blis-rng.md §3.1).
        start = bisect.bisect_left(self._bad, pos)
        self._bad = [b - pos for b in self._bad[start:]] + (bad_new + left.shape[0]).tolist()
        self._arr = np.concatenate([left, new]) if left.shape[0] else new
        self._list = None
        self._pos = 0

    def _words(self) -> list[int]:
        if self._list is None:
            self._list = self._arr.tolist()
        return self._list

    def uint64(self) -> int:
        if self._pos >= self._arr.shape[0]:
            self._refill(1)
        words = self._list if self._list is not None else self._words()
        v = words[self._pos]
        self._pos += 1
        self.drawn += 1
        return v

    def uint64_block(self, n: int) -> np.ndarray:
        """The next n `Uint64` values (np.uint64)."""
        self._refill(n)
        out = self._arr[self._pos:self._pos + n].copy()
        self._pos += n
        self.drawn += n
        return out

    def int63(self) -> int:
        return self.uint64() & _MASK63

    def uint32(self) -> int:
        return (self.uint64() & _MASK63) >> 31

    def int31(self) -> int:
        return (self.uint64() & _MASK63) >> 32

    # --------------------------------------------------------------- bounded integers

    def int63n(self, n: int) -> int:
        if n <= 0:
            raise ValueError("invalid argument to Int63n")
        if n & (n - 1) == 0:
            return self.int63() & (n - 1)
        top = _MASK63 - (1 << 63) % n
        v = self.int63()
        while v > top:
            v = self.int63()
        return v % n

    def int31n(self, n: int) -> int:
        if n <= 0:
            raise ValueError("invalid argument to Int31n")
        if n & (n - 1) == 0:
            return self.int31() & (n - 1)
        top = _INT32_MAX - (1 << 31) % n
        v = self.int31()
        while v > top:
            v = self.int31()
        return v % n

    def intn(self, n: int) -> int:
        if n <= 0:
            raise ValueError("invalid argument to Intn")
        return self.int31n(n) if n <= _INT32_MAX else self.int63n(n)

    def _lemire31n(self, n: int) -> int:
        """Go's unexported `int31n` (multiply-shift), used by Shuffle."""
        prod = self.uint32() * n
        low = prod & 0xFFFFFFFF
        if low < n:
            thresh = ((1 << 32) - n) % n
            while low < thresh:
                prod = self.uint32() * n
                low = prod & 0xFFFFFFFF
        return prod >> 32

    # ----------------------------------------------------------------------- floats

    def float64(self) -> float:
        while True:
            f = (self.uint64() & _MASK63) / _TWO63
            if f != 1.0:
                return f

    def norm_float64(self) -> float:
        while True:
            u = (self.uint64() & _MASK63) >> 31
            j = u - (1 << 32) if u >= (1 << 31) else u       # int32(Uint32())
            i = j & 0x7F
            x = float(j) * _WN[i]
            if abs(j) < _KN[i]:
                return x
            if i == 0:
                while True:
                    x = -go_log(self.float64()) * _RN_INV
                    y = -go_log(self.float64())
                    if y + y >= x * x:
                        break
                return _RN + x if j > 0 else -_RN - x
            if _FN[i] + np.float32(self.float64()) * (_FN[i - 1] - _FN[i]) < np.float32(math.exp(-.5 * x * x)):
                return x

    def exp_float64(self) -> float:
        while True:
            j = (self.uint64() & _MASK63) >> 31
            i = j & 0xFF
            x = float(j) * _WE[i]
            if j < _KE[i]:
                return x
            if i == 0:
                return _RE - go_log(self.float64())
            if _FE[i] + np.float32(self.float64()) * (_FE[i - 1] - _FE[i]) < np.float32(math.exp(-x)):
                return x

    # ------------------------------------------------------------------ permutations

    def perm(self, n: int) -> list[int]:
        m = [0] * n
        for i in range(n):
            j = self.intn(i + 1)
            m[i] = m[j]
            m[j] = i
        return m

    def shuffle(self, n: int, swap) -> None:
        """Go's `Shuffle(n, swap)` for n < 2³¹ (Lemire bounded draws)."""
        if n < 0:
            raise ValueError("invalid argument to Shuffle")
        for i in range(n - 1, 0, -1):
            swap(i, self._lemire31n(i + 1))

    # ------------------------------------------------------------------- token IDs

    def _token_words(self, n: int) -> int:
        """Words consumed by n successive Intn(128000) draws from the cursor (buffers them)."""
        if n <= 0:
            return 0
        while True:
            pos = self._pos
            bad = self._bad
            lo = bisect.bisect_left(bad, pos)
            # The n-th accepted word sits at pos + n − 1 + k, k = rejected words before it.
            k = 0
            while lo + k < len(bad) and bad[lo + k] - pos - k <= n - 1:
                k += 1
            if pos + n + k <= self._arr.shape[0]:
                return n + k
            self._refill(n + k + 16 + n // 4096)

    def _check_token_budget(self, n: int) -> None:
        if self.drawn + n > MAX_TOKEN_DRAWS:
            from blis_jax.errors import ConfigError

            raise ConfigError(f"the workload needs over {MAX_TOKEN_DRAWS:,} token IDs from one stream "
                              f"({n:,} for one request; one per token, as in BLIS); lower the token "
                              "lengths or the number of requests")

    def tokens(self, n: int) -> np.ndarray:
        """n successive `Intn(128000)` values (BLIS's token IDs, blis-rng.md §3.1)."""
        self._check_token_budget(n)
        parts = []
        while n > 0 or not parts:
            m = min(n, _MAX_CHUNK)
            used = self._token_words(m)
            block = self._arr[self._pos:self._pos + used]
            good = ((block >> np.uint64(32)) & np.uint64(_INT32_MAX)).astype(np.int64)
            if used > m:
                good = good[good <= _TOKEN_MAX]
            self._pos += used
            self.drawn += used
            parts.append(good % TOKEN_VOCAB)
            n -= m
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def skip_tokens(self, n: int) -> None:
        """Consume n `Intn(128000)` draws without returning them (only equality of token IDs
        matters to the simulation; the stream position matters to every later draw)."""
        self._check_token_budget(n)
        while n > 0:                   # bounded blocks keep memory small for huge n
            m = min(n, _MAX_CHUNK)
            used = self._token_words(m)
            self._pos += used
            self.drawn += used
            n -= m

    # --------------------------------------------------------------------- state

    def register(self) -> tuple[np.ndarray, int, int]:
        """Go's (vec, tap, feed) at the current position, in the layout tap 0, feed 334 (the
        stream continues identically from it). Used to carry the stream into a jitted loop."""
        seq = np.concatenate([self._hist, self._arr[:self._pos]])[-LEN:]
        j = np.arange(1, LEN + 1)
        reg = np.empty(LEN, dtype=np.uint64)
        reg[(LEN - TAP - 1 + j) % LEN] = seq[LEN - j]
        return reg, 0, LEN - TAP
