"""Go math/rand v1 port (blis_jax/rng/go_rand.py) against the real Go generator's output
(../shared/reference/go-math-rand/vectors.json: 8 seeds × 9 streams from fresh sources)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from blis_jax.rng import _go_tables
from blis_jax.rng.go_rand import GoRand, go_log, go_round
from shared_data import REFERENCE, needs  # noqa: E402

GO_RAND = REFERENCE / "go-math-rand"
pytestmark = needs(GO_RAND, "Go math/rand reference vectors")


def _vectors():
    return json.loads((GO_RAND / "vectors.json").read_text())


def _streams():
    if not (GO_RAND / "vectors.json").is_file():  # no ../shared: the module is skipped (pytestmark)
        return []
    data = _vectors()["vectors"]
    return [pytest.param(v, id=str(v["seed"])) for v in data]


DRAWS = {
    "int63": lambda r: r.int63(),
    "uint64": lambda r: r.uint64(),
    "float64": lambda r: r.float64(),
    "intn_10": lambda r: r.intn(10),
    "intn_1000003": lambda r: r.intn(1000003),
    "int63n_1e12": lambda r: r.int63n(10**12),
    "int31n_7": lambda r: r.int31n(7),
    "norm_float64": lambda r: r.norm_float64(),
    "exp_float64": lambda r: r.exp_float64(),
}


@pytest.mark.parametrize("vec", _streams())
def test_every_stream_matches_go(vec):
    for name, draw in DRAWS.items():
        r = GoRand(vec["seed"])
        got = [draw(r) for _ in vec[name]]
        assert got == vec[name], name        # exact, floats included
    assert GoRand(vec["seed"]).perm(12) == vec["perm_12"]
    r = GoRand(vec["seed"])
    cycle = [lambda: r.norm_float64(), lambda: r.float64(), lambda: r.exp_float64(), lambda: r.intn(97)]
    assert [cycle[i % 4]() for i in range(len(vec["mixed_sequence"]))] == vec["mixed_sequence"]


def test_tables_are_gos():
    tables = json.loads((GO_RAND / "tables.json").read_text())
    assert list(_go_tables.RNG_COOKED) == tables["rngCooked_int64"]
    assert list(_go_tables.KN) == tables["kn_uint32"] and list(_go_tables.KE) == tables["ke_uint32"]
    for ours, key in ((_go_tables.WN, "wn"), (_go_tables.FN, "fn"), (_go_tables.WE, "we"), (_go_tables.FE, "fe")):
        assert list(ours) == tables[f"{key}_float32_literals"]


def test_fnv_hashes_of_subsystems():
    from blis_jax.rng.streams import fnv1a64
    for name, h in _vectors()["fnv1a64"].items():
        assert fnv1a64(name) == h


def test_token_blocks_equal_scalar_intn():
    # A stream position with rejections inside the block: the vectorized draw must consume
    # exactly what n scalar Intn(128000) calls consume.
    a, b = GoRand(7079132663427089781), GoRand(7079132663427089781)
    for n in (1, 5, 273, 1000, 70_000, 3):
        got = a.tokens(n)
        want = [b.intn(128000) for _ in range(n)]
        assert got.tolist() == want
        assert a.drawn == b.drawn
    assert a.int63() == b.int63()
    c = GoRand(7079132663427089781)
    c.skip_tokens(1 + 5 + 273 + 1000 + 70_000 + 3)
    assert c.drawn == a.drawn - 1


def test_token_rejections_counted():
    # 2^31 mod 128000 = 27 648: Int31 values above 2 147 455 999 are rejected (blis-rng.md §3.1).
    r = GoRand(1)
    words = r.uint64_block(400_000)
    v = (words >> np.uint64(32)) & np.uint64(2**31 - 1)
    rejected = int((v > 2_147_455_999).sum())
    assert rejected > 0
    s = GoRand(1)
    s.skip_tokens(400_000 - rejected - 1)
    assert s.drawn <= 400_000


def test_uint64_block_and_scalar_agree_across_refills():
    a, b = GoRand(-3), GoRand(-3)
    out = np.concatenate([a.uint64_block(1), a.uint64_block(600), a.uint64_block(5000)])
    assert out.tolist() == [b.uint64() for _ in range(5601)]


def test_register_continues_the_stream():
    r = GoRand(42)
    for _ in range(1000):
        r.uint64()
    reg, tap, feed = r.register()
    vec = [int(x) for x in reg]
    nxt = []
    for _ in range(700):           # Go's Uint64 on the exported register
        tap = (tap - 1) % 607
        feed = (feed - 1) % 607
        vec[feed] = (vec[feed] + vec[tap]) % 2**64
        nxt.append(vec[feed])
    assert nxt == [r.uint64() for _ in range(700)]


def test_shuffle_is_lemire_and_perm_is_inside_out():
    r = GoRand(5)
    items = list(range(50))
    r.shuffle(50, lambda i, j: items.__setitem__(slice(None), _swap(items, i, j)))
    assert sorted(items) == list(range(50)) and items != list(range(50))


def _swap(items, i, j):
    items[i], items[j] = items[j], items[i]
    return items


def test_go_log_and_round():
    assert go_log(0.0) == -math.inf and go_log(1.0) == 0.0
    # Go's Log is within 1 ulp of libm's on every argument.
    rng = np.random.default_rng(0)
    for x in rng.random(2000):
        assert abs(go_log(float(x)) - math.log(x)) <= 2 * math.ulp(math.log(x))
    assert go_round(0.5) == 1.0 and go_round(-0.5) == -1.0 and go_round(2.5) == 3.0
    assert go_round(0.49999999999999994) == 0.0


def test_subsystem_seeds_of_the_spec():
    from blis_jax.rng.streams import PartitionedRNG, subsystem_seed
    assert subsystem_seed(42, "workload-gen") == 7079132663427089781
    assert subsystem_seed(42, "router") == -6855704586828941970
    assert subsystem_seed(42, "workload") == 42
    p = PartitionedRNG(42)
    s = p.for_subsystem("workload-gen")
    assert s is p.for_subsystem("workload-gen")
    # First Int63 of the seed-42 workload-gen stream: A01's client seed (blis-rng.md §14).
    assert s.int63() == 8021973113318348621


def test_jax_stream_draws_gos_intn():
    import jax
    import jax.numpy as jnp

    from blis_jax.rng.go_jax import go_stream, intn, intn_if
    from blis_jax.rng.streams import subsystem_seed

    seed = subsystem_seed(9, "router")
    want = GoRand(seed)
    s = go_stream(seed)
    step = jax.jit(intn)
    ns = [4, 3, 2, 4, 7, 1000003, 1 << 20, 5, 1, 2]
    for n in ns * 30:
        s, v = step(s, jnp.int64(n))
        assert int(v) == want.intn(n)
    s2, v = jax.jit(intn_if)(s, jnp.int64(5), jnp.asarray(False))       # no draw: stream unchanged
    assert int(v) == 0 and (s2.vec == s.vec).all() and int(s2.tap) == int(s.tap)
    # vmapped lanes with their own seeds
    lanes = jax.tree.map(lambda *x: jnp.stack(x), go_stream(1), go_stream(2))
    _, v = jax.vmap(intn, in_axes=(0, None))(lanes, jnp.int64(6))
    assert v.tolist() == [GoRand(1).intn(6), GoRand(2).intn(6)]
