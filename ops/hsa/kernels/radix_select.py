"""Radix select over a row of 32-bit keys in one CTA, with ties broken by the smaller index: the HSA top-k's
fallback for crowded rows. No HSA constants: every macro takes the CTA's thread count ``threads`` (a power of two
up to the histogram's RADIX_BINS bins of an 8-bit digit) and ``idx_bits``, the bits of a key's index in the row (a
multiple of 8). Each digit's bin is found by the shared ``ops.common.tl.radix.pick_digit``.

A row is ``keys[b, h, :n]`` (0 marks a key that never wins); the threads stream it in batches of
``KEY_BATCH`` loads each, thread tx's load e of batch it reading index ``page_of(it, e, tx, threads)``.
Keys are ordered by their *composite* (key, then the smaller index first): the 64-bit value
``key << idx_bits | (2**idx_bits - 1 - index)``, > 0 for every key != 0.

  load_batch   one batch of a thread's keys into registers (past n: 0)
  scatter      the composites of every key a predicate accepts, into a shared array
  select       the k winners' composites, unordered: 8-bit digits of the composite from the top, one
               shared histogram per digit, stopping once the k-th key's digits are settled
"""

import tilelang.language as T

from ...common.tl.radix import RADIX_BINS, pick_digit

KEY_BATCH = 8  # keys each thread loads at once (issued together, not one per round trip)


def page_of(it, e, tx, threads: int):
    """Index in the row of load e of a thread's batch it: a batch's loads cover `threads` consecutive
    indices each."""
    return (it * KEY_BATCH + e) * threads + tx


def composite(key, page, idx_bits: int):
    """(key, smaller index first) as one unsigned order; > 0 for every candidate (key != 0)."""
    idx_top = (1 << idx_bits) - 1
    return (T.cast(key, "uint64") << idx_bits) | T.cast(idx_top - page, "uint64")


def at_or_above(pu, mu, pr, mr, idx_bits: int):
    """The predicate of the radix select's winners, as wins(key, index): the keys at or above the k-th key's
    settled digits, key digits (pu under mask mu) then index digits (pr under mask mr)."""
    idx_top = (1 << idx_bits) - 1

    def wins(key, page):
        r = T.cast(idx_top - page, "uint32")
        return T.Or((key & mu) > pu, T.And((key & mu) == pu, (r & mr) >= pr))
    return wins


@T.macro
def load_batch(keys, kbuf, b, h, n, it, tx, threads: int):
    """kbuf[e] = key of index page_of(it, e, tx) of the row keys[b, h, :n] (0 past n). The loads are
    issued together, not one per round trip."""
    for e in T.unroll(KEY_BATCH):
        kbuf[e] = T.if_then_else(page_of(it, e, tx, threads) < n, keys[b, h, page_of(it, e, tx, threads)],
                                 T.uint32(0))


@T.macro
def scatter(keys, b, h, n, wins, counter, ci, limit, comp, threads: int, idx_bits: int):
    """comp[slot] = composite of every key of the row keys[b, h, :n] for which wins(key, index) holds, in the
    order the threads claim slots (< limit) from the shared counter[ci]; a barrier follows."""
    tx = T.get_thread_binding()
    kbuf = T.alloc_local((KEY_BATCH,), "uint32")
    for it in T.serial(T.ceildiv(n, threads * KEY_BATCH)):
        load_batch(keys, kbuf, b, h, n, it, tx, threads)
        for e in T.unroll(KEY_BATCH):
            if kbuf[e] != T.uint32(0) and wins(kbuf[e], page_of(it, e, tx, threads)):
                slot = T.atomic_add(counter[ci], 1, return_prev=True)
                # Stored as atomics: TileLang's sync planner then sees no hazard against the counter's
                # atomic and puts no barrier here. It would keep one inside this branch (its condition
                # reads only thread-local values, which it takes for block-uniform) and the CTA would
                # hang there: the threads without a winner never reach it.
                if slot < limit:
                    T.atomic_store(comp[slot], composite(kbuf[e], page_of(it, e, tx, threads), idx_bits),
                                   memory_order="relaxed")
    T.sync_threads()


@T.macro
def select(keys, b, h, n, k_eff, comp, threads: int, idx_bits: int):
    """Radix select over the composite (key, idx_top - index): 8-bit digits, one shared histogram per digit,
    stopping as soon as the k_eff-th key's digits are settled (the index digits only matter on exact key
    ties). The k_eff winners go to comp[:k_eff] as composites, unordered. Each digit's bin comes from
    pick_digit (warp 0; threads a power of two from 32 to RADIX_BINS)."""
    idx_top = (1 << idx_bits) - 1
    tx = T.get_thread_binding()
    hist = T.alloc_shared((RADIX_BINS,), "int32")
    # 0: chosen digit, 1: rank still to fill inside the chosen bin, 2: winners written
    state = T.alloc_shared((3,), "int32")
    tmp = T.alloc_local((4,), "int32")
    kbuf = T.alloc_local((KEY_BATCH,), "uint32")
    # Settled high digits of the k-th key: key (pu, mu), then index (pr, mr).
    pu = T.alloc_var("uint32", T.uint32(0))
    mu = T.alloc_var("uint32", T.uint32(0))
    pr = T.alloc_var("uint32", T.uint32(0))
    mr = T.alloc_var("uint32", T.uint32(0))
    need = T.alloc_var("int32")  # rank of the k-th key among keys matching the prefix
    need = k_eff
    done = T.alloc_var("int32", 0)
    n_batches = T.ceildiv(n, threads * KEY_BATCH)

    for p in T.serial(4 + idx_bits // 8):
        if done == 0:
            on_score = p < 4
            shift = T.if_then_else(on_score, 24 - 8 * p, idx_bits - 8 - 8 * (p - 4))
            for i in T.unroll(RADIX_BINS // threads):
                hist[i * threads + tx] = 0
            if tx == 0:
                state[0] = 0
                state[1] = need
            T.sync_threads()
            for it in T.serial(n_batches):
                load_batch(keys, kbuf, b, h, n, it, tx, threads)
                for e in T.unroll(KEY_BATCH):
                    u = kbuf[e]
                    r = T.cast(idx_top - page_of(it, e, tx, threads), "uint32")
                    if u != T.uint32(0) and (u & mu) == pu and (r & mr) == pr:
                        digit = T.if_then_else(on_score, u >> T.cast(shift, "uint32"),
                                               r >> T.cast(shift, "uint32")) & T.uint32(0xFF)
                        T.atomic_add(hist[T.cast(digit, "int32")], 1)
            T.sync_threads()
            # The row holds at least k_eff keys (k_eff <= their count), so a bin is always found. When it holds
            # exactly the keys still needed, all of them win; at the first digit that is every candidate.
            pick_digit(hist, state[1], tmp, tx, state[0], 0)
            T.sync_threads()
            need = state[1]
            digit_mask = T.uint32(0xFF) << T.cast(shift, "uint32")
            chosen = T.cast(state[0], "uint32") << T.cast(shift, "uint32")
            if on_score:
                pu = pu | chosen
                mu = mu | digit_mask
            else:
                pr = pr | chosen
                mr = mr | digit_mask
            if hist[state[0]] == need:
                done = 1
            T.sync_threads()

    if tx == 0:
        state[2] = 0
    T.sync_threads()
    scatter(keys, b, h, n, at_or_above(pu, mu, pr, mr, idx_bits), state, 2, k_eff, comp, threads, idx_bits)
