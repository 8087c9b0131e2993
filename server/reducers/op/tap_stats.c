/* layertap::tap_stats on CPU: the basic statistics of one strided float tensor, read once.
 *
 * Why C: a firing's host cost is the product (issue 42). An aten-op body runs
 * about ten kernels of 1-3 us each on a small tensor; this loop reads a
 * 1,024-float tensor in about a microsecond, called through ctypes from the
 * op's CPU kernel. Compiled at first use by layertap.server.reducers.op.cpu.
 *
 * The row it merges into (8 float64 slots, reducers.kernels' layout):
 *   [zeros, nan, count_finite, sum(x-K), sum((x-K)^2), K, min, max]
 * must hold the identity (0, 0, 0, 0, 0, 0, +inf, -inf) or an earlier merge
 * with the same K; K is the lower median of the finite values among 32
 * evenly spaced logical positions (op.reference.sample_positions).
 *
 * Elements are visited in logical (row-major) order through their strides, so
 * a stride-0 (expanded) or overlapping view counts as the logical tensor. A
 * mask of the leading dims (uint8, contiguous, mask_inner elements each)
 * leaves out every element under a 0 entry, as padding and request cuts do.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { F32 = 0, F64 = 1, F16 = 2, BF16 = 3 };
#define SAMPLE 32
#define MAX_DIMS 16

static double half_to_double(uint16_t h) {
    uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    double v;
    if (exp == 0) v = ldexp((double)man, -24);
    else if (exp == 31) v = man ? NAN : INFINITY;
    else v = ldexp((double)(man | 0x400u), (int)exp - 25);
    return sign ? -v : v;
}

static double bf16_to_double(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return (double)f;
}

static inline double load(const char *base, int64_t off, int dtype) {
    switch (dtype) {
    case F32: return (double)((const float *)base)[off];
    case F64: return ((const double *)base)[off];
    case F16: return half_to_double(((const uint16_t *)base)[off]);
    default: return bf16_to_double(((const uint16_t *)base)[off]);
    }
}

static int64_t offset_of(int64_t index, int ndim, const int64_t *sizes, const int64_t *strides) {
    int64_t off = 0;
    for (int d = ndim - 1; d >= 0; d--) {
        off += (index % sizes[d]) * strides[d];
        index /= sizes[d];
    }
    return off;
}

/* Returns 0; 1 when ndim is out of range, 2 when *row_index is not a row of out (nothing written). */
int layertap_tap_stats(const void *x, int dtype, int ndim, const int64_t *sizes, const int64_t *strides,
                       double *out, int64_t rows, const int64_t *row_index, const int32_t *flag,
                       const uint8_t *mask, int64_t mask_inner) {
    if (*flag == 0) return 0;
    if (ndim < 0 || ndim > MAX_DIMS) return 1;
    if (*row_index < 0 || *row_index >= rows) return 2;
    double *row = out + *row_index * 8;
    const char *base = (const char *)x;
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++) numel *= sizes[d];
    if (mask == NULL || mask_inner <= 0) mask_inner = numel > 0 ? numel : 1;

    /* The shift K: lower median of the finite, unmasked sampled values (0 when none). */
    double s[SAMPLE];
    int cnt = 0;
    int64_t m = numel < SAMPLE ? numel : SAMPLE;
    int64_t step = m > 0 ? numel / m : 1;
    for (int64_t j = 0; j < m; j++) {
        int64_t i = j * step;
        if (mask != NULL && !mask[i / mask_inner]) continue;
        double v = load(base, offset_of(i, ndim, sizes, strides), dtype);
        if (!isfinite(v)) continue;
        int k = cnt++;
        while (k > 0 && s[k - 1] > v) { s[k] = s[k - 1]; k--; }
        s[k] = v;
    }
    double K = cnt > 0 ? s[(cnt - 1) / 2] : 0.0;

    int64_t zeros = 0, nan = 0, count = 0;
    double s1 = 0.0, s2 = 0.0, lo = INFINITY, hi = -INFINITY;
    int64_t idx[MAX_DIMS];
    int last = ndim - 1;
    int64_t inner = ndim > 0 ? sizes[last] : 1, inner_stride = ndim > 0 ? strides[last] : 0;
    for (int64_t p = 0; p * mask_inner < numel; p++) {
        if (mask != NULL && !mask[p]) continue;
        int64_t start = p * mask_inner, end = start + mask_inner;
        /* The multi-index of `start`; then rows of the last dim, an odometer over the rest. */
        int64_t rest = start;
        for (int d = last; d >= 0; d--) { idx[d] = rest % sizes[d]; rest /= sizes[d]; }
        int64_t i = start;
        while (i < end) {
            int64_t off = 0;
            for (int d = 0; d < last; d++) off += idx[d] * strides[d];
            int64_t k0 = ndim > 0 ? idx[last] : 0;
            int64_t k1 = inner;
            if (end - i < k1 - k0) k1 = k0 + (end - i);
            for (int64_t k = k0; k < k1; k++) {
                double v = load(base, off + k * inner_stride, dtype);
                if (v == 0.0) zeros++;
                if (v != v) { nan++; continue; }
                if (v == INFINITY || v == -INFINITY) continue;
                count++;
                double y = v - K;
                s1 += y;
                s2 += y * y;
                if (v < lo) lo = v;
                if (v > hi) hi = v;
            }
            i += k1 - k0;
            if (ndim == 0) break;
            idx[last] = 0;
            for (int d = last - 1; d >= 0; d--) {
                if (++idx[d] < sizes[d]) break;
                idx[d] = 0;
            }
        }
    }
    row[0] += (double)zeros;
    row[1] += (double)nan;
    row[2] += (double)count;
    row[3] += s1;
    row[4] += s2;
    row[5] = K;
    if (lo < row[6]) row[6] = lo;
    if (hi > row[7]) row[7] = hi;
    return 0;
}
