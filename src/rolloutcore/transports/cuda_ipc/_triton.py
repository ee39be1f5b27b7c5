"""The Triton kernels behind ``cuda_kernels`` (imported only when they are used).

At module level so that a kernel can call another (``triton.jit`` resolves
callees through the module's globals, also under ``TRITON_INTERPRET=1``).
"""
# mypy: disable-error-code="untyped-decorator,no-untyped-def,import-untyped,unused-ignore"

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def csum_tile(base, offs, rows, grow0, item_t, item_r, it,
              R: tl.constexpr, C: tl.constexpr, W_MUL: tl.constexpr,
              W_ADD: tl.constexpr, FLAT: tl.constexpr):
    """The weighted sum of one work item's R blocks (int64)."""
    t = tl.load(item_t + it)
    r0 = tl.load(item_r + it)
    nrows = tl.load(rows + t)
    off = tl.multiple_of(tl.load(offs + t), 4)
    g0 = tl.load(grow0 + t)
    # One 64-bit base address per item; 32-bit offsets inside the tile.
    p = base + (off + r0 * C)
    ri = tl.arange(0, R)
    r = r0 + ri.to(tl.int64)
    live = r < nrows
    if FLAT:
        # The tile as one run of words (the copy kernel's access pattern),
        # then viewed as R blocks of C.
        j = tl.arange(0, R * C)
        left = (nrows - r0) * C
        x = tl.load(p + j, mask=j < left, other=0)
        s = tl.sum(tl.reshape(x, (R, C)), axis=1)
    else:
        x = tl.load(p + (ri[:, None] * C + tl.arange(0, C)[None, :]),
                    mask=live[:, None], other=0)
        s = tl.sum(x, axis=1)
    # int32 sums wrap mod 2**32, which is the definition; only the R block
    # sums are widened (widening the whole tile first ran at 700 GB/s).
    s = s.to(tl.int64) & 0xFFFFFFFF
    gi = g0 + r
    w = ((gi * W_MUL + W_ADD) & 0x7FFFFFFF) | 1
    term = tl.where(live, (s * w) & 0xFFFFFFFF, 0)
    return tl.sum(term, axis=0)


@triton.jit
def csum_kernel(base, offs, rows, grow0, item_t, item_r, out,
                R: tl.constexpr, C: tl.constexpr, W_MUL: tl.constexpr,
                W_ADD: tl.constexpr, FLAT: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(out + pid, csum_tile(base, offs, rows, grow0, item_t, item_r, pid,
                                  R, C, W_MUL, W_ADD, FLAT))


@triton.jit
def csum_loop_kernel(base, offs, rows, grow0, item_t, item_r, out,
                     n_items, R: tl.constexpr, C: tl.constexpr, W_MUL: tl.constexpr,
                     W_ADD: tl.constexpr, FLAT: tl.constexpr):
    # Persistent programs: a few per SM, each walking the work table with
    # a stride, so the table reads of one item overlap the tile of another.
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    for it in tl.range(pid, n_items, step, num_stages=2):
        tl.store(out + it, csum_tile(base, offs, rows, grow0, item_t, item_r, it,
                                     R, C, W_MUL, W_ADD, FLAT))


@triton.jit
def csum_small_kernel(base, offs, rows, cols, grow0, item_t, item_r, out,
                      R: tl.constexpr, C: tl.constexpr, W_MUL: tl.constexpr,
                      W_ADD: tl.constexpr):
    """Tensors whose blocks are narrower than C words (a runtime width per tensor).

    Scalar loads and 4-byte alignment only: these are the few small tensors
    (norm weights) that the vectorized kernel cannot take.
    """
    pid = tl.program_id(0)
    t = tl.load(item_t + pid)
    r0 = tl.load(item_r + pid)
    nrows = tl.load(rows + t)
    ncols = tl.load(cols + t)
    g0 = tl.load(grow0 + t)
    p = base + (tl.load(offs + t) + r0 * ncols)
    ri = tl.arange(0, R)
    ci = tl.arange(0, C)
    r = r0 + ri.to(tl.int64)
    live = r < nrows
    x = tl.load(p + (ri[:, None] * ncols + ci[None, :]),
                mask=live[:, None] & (ci < ncols)[None, :], other=0)
    s = tl.sum(x, axis=1).to(tl.int64) & 0xFFFFFFFF
    w = (((g0 + r) * W_MUL + W_ADD) & 0x7FFFFFFF) | 1
    tl.store(out + pid, tl.sum(tl.where(live, (s * w) & 0xFFFFFFFF, 0), axis=0))


@triton.jit
def copy_kernel(dbase, sbase, doffs, soffs, words, item_t, item_w,
                B: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(item_t + pid)
    w0 = tl.multiple_of(tl.load(item_w + pid), B)
    n = tl.multiple_of(tl.load(words + t), 4)
    do = tl.multiple_of(tl.load(doffs + t), 4)
    so = tl.multiple_of(tl.load(soffs + t), 4)
    j = tl.arange(0, B)
    m = j < n - w0
    v = tl.load(sbase + (so + w0) + j, mask=m)
    tl.store(dbase + (do + w0) + j, v, mask=m)

