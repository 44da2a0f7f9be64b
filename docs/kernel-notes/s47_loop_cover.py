"""The s47 moe_few_down loop structure (PIPE and not, N2 and N8 rounds): every (unit, item row) is computed exactly
once, from the batch whose weights were loaded for that unit."""
import itertools
import random

def run(units, nch, item_rows, NW, CPW, PIPE, N8):
    seen = {}
    for w in range(NW):
        step = NW * CPW
        loaded = {}  # buffer -> u0 of the batch loaded into it
        def load(buf, u0):
            loaded[buf] = u0
        def run_batch(buf, u0):
            assert loaded[buf] == u0, (buf, loaded[buf], u0)
            nr = [item_rows[(u0 + i) // nch] if u0 + i < units else 0 for i in range(CPW)]
            most = max(nr)
            tile = 8 if N8 else 2
            for q0 in range(0, most, tile):
                for i in range(CPW):
                    if q0 >= nr[i]:
                        continue
                    for r in range(q0, min(q0 + tile, nr[i])):
                        key = (u0 + i, r)
                        assert key not in seen, key
                        seen[key] = w
        u0 = w * CPW
        load("a", u0)
        if PIPE:
            load("b", u0 + step)
            while u0 < units:
                run_batch("a", u0)
                if u0 + step >= units:
                    break
                load("a", u0 + 2 * step)
                run_batch("b", u0 + step)
                if u0 + 2 * step >= units:
                    break
                load("b", u0 + 3 * step)
                u0 += 2 * step
        else:
            while True:
                run_batch("a", u0)
                u0 += step
                if u0 >= units:
                    break
                load("a", u0)
    want = {(u, r) for u in range(units) for r in range(item_rows[u // nch])}
    assert set(seen) == want, (len(seen), len(want))

rng = random.Random(0)
n = 0
for _ in range(3000):
    nch = rng.choice([1, 2, 16])
    ni = rng.randint(0, 40)
    item_rows = [rng.randint(1, 16) for _ in range(ni)]
    for NW, CPW, PIPE, N8 in itertools.product((1, 2, 4, 8), (2, 4), (False, True), (False, True)):
        run(ni * nch, nch, item_rows, NW, CPW, PIPE, N8)
        n += 1
print("ok", n)
