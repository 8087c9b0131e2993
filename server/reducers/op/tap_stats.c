/* layertap::tap_stats on CPU: the basic statistics of one strided float tensor, read once.
 *
 * Why C: a firing's host cost is the product (issue 42). An aten-op body runs
 * about ten kernels of 1-3 us each on a small tensor; this loop reads a
 * 1,024-float tensor in about a microsecond. Plain C99 plus GCC/clang vector
 * types, so the math reads apart from torch; tap_stats_op.cpp includes it in
 * the op's CPU kernel, built at first use by layertap.server.reducers.op.cpu.
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

static inline double load_f32(const char *b, int64_t o) { return (double)((const float *)b)[o]; }
static inline double load_f64(const char *b, int64_t o) { return ((const double *)b)[o]; }
static inline double load_f16(const char *b, int64_t o) { return half_to_double(((const uint16_t *)b)[o]); }
static inline double load_bf16(const char *b, int64_t o) { return bf16_to_double(((const uint16_t *)b)[o]); }

static inline double load(const char *base, int64_t off, int dtype) {
    switch (dtype) {
    case F32: return load_f32(base, off);
    case F64: return load_f64(base, off);
    case F16: return load_f16(base, off);
    default: return load_bf16(base, off);
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
/* The inner loop over one run of the last dim: four independent accumulators, no branch, so the
 * float64 adds pipeline (a single chain waits four cycles per element). */
#define STEP(v, a1, a2, l, h)                                                               \
    do {                                                                                    \
        int fin_ = fabs(v) < INFINITY;                                                      \
        z += (v) == 0.0;                                                                    \
        nn += (v) != (v);                                                                   \
        c += fin_;                                                                          \
        if (full) {                                                                         \
            double y_ = fin_ ? (v) - K : 0.0;                                               \
            a1 += y_;                                                                       \
            a2 += y_ * y_;                                                                  \
            l = fin_ && (v) < l ? (v) : l;                                                  \
            h = fin_ && (v) > h ? (v) : h;                                                  \
        }                                                                                   \
    } while (0)

#define RUN(T, LOAD)                                                                        \
    static void run_##T(const char *base, int64_t off, int64_t n, int64_t stride, double K,   \
                        int full, int64_t *zeros, int64_t *nan, int64_t *count, double *s1,  \
                        double *s2, double *lo, double *hi) {                               \
        double p0 = 0, p1 = 0, p2 = 0, p3 = 0, q0 = 0, q1 = 0, q2 = 0, q3 = 0;              \
        double l0 = INFINITY, l1 = INFINITY, l2 = INFINITY, l3 = INFINITY;                  \
        double h0 = -INFINITY, h1 = -INFINITY, h2 = -INFINITY, h3 = -INFINITY;              \
        int64_t z = 0, nn = 0, c = 0, k = 0;                                                \
        for (; k + 4 <= n; k += 4) {                                                        \
            double v0 = LOAD(base, off + k * stride), v1 = LOAD(base, off + (k + 1) * stride); \
            double v2 = LOAD(base, off + (k + 2) * stride), v3 = LOAD(base, off + (k + 3) * stride); \
            STEP(v0, p0, q0, l0, h0);                                                       \
            STEP(v1, p1, q1, l1, h1);                                                       \
            STEP(v2, p2, q2, l2, h2);                                                       \
            STEP(v3, p3, q3, l3, h3);                                                       \
        }                                                                                   \
        for (; k < n; k++) {                                                                \
            double v0 = LOAD(base, off + k * stride);                                       \
            STEP(v0, p0, q0, l0, h0);                                                       \
        }                                                                                   \
        *zeros += z; *nan += nn; *count += c;                                               \
        *s1 += (p0 + p1) + (p2 + p3);                                                       \
        *s2 += (q0 + q1) + (q2 + q3);                                                       \
        l0 = l1 < l0 ? l1 : l0; l2 = l3 < l2 ? l3 : l2; l0 = l2 < l0 ? l2 : l0;             \
        h0 = h1 > h0 ? h1 : h0; h2 = h3 > h2 ? h3 : h2; h0 = h2 > h0 ? h2 : h0;             \
        if (l0 < *lo) *lo = l0;                                                             \
        if (h0 > *hi) *hi = h0;                                                             \
    }

RUN(f32, load_f32)
RUN(f64, load_f64)
RUN(f16, load_f16)
RUN(bf16, load_bf16)

/* The contiguous case (a run of stride 1, most tensors): GCC/clang vector types, four float64
 * lanes, so the compiler emits SIMD for whatever the machine has. Masks are all-ones lanes. */
typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));

static inline v4d select4(v4l m, v4d a, v4d b) { return (v4d)(((v4l)a & m) | ((v4l)b & ~m)); }

#define VRUN(T, LOAD)                                                                       \
    static void vrun_##T(const char *base, int64_t off, int64_t n, double K, int full,       \
                         int64_t *zeros, int64_t *nan, int64_t *count, double *s1, double *s2, \
                         double *lo, double *hi) {                                          \
        const v4d inf = {INFINITY, INFINITY, INFINITY, INFINITY}, ninf = -inf;              \
        const v4d kv = {K, K, K, K}, zero = {0, 0, 0, 0};                                   \
        const v4l absmask = {INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX};                   \
        v4d a1 = zero, a2 = zero, l = inf, h = ninf;                                        \
        v4l z = {0, 0, 0, 0}, nn = z, c = z;                                                \
        int64_t k = 0;                                                                      \
        for (; k + 4 <= n; k += 4) {                                                        \
            v4d v = {LOAD(base, off + k), LOAD(base, off + k + 1), LOAD(base, off + k + 2),  \
                     LOAD(base, off + k + 3)};                                              \
            v4l fin = (v4d)((v4l)v & absmask) < inf;                                        \
            z -= v == zero;                                                                 \
            nn -= v != v;                                                                   \
            c -= fin;                                                                       \
            if (full) {                                                                     \
                v4d y = (v4d)((v4l)(v - kv) & fin);                                         \
                a1 += y;                                                                    \
                a2 += y * y;                                                                \
                v4d vl = select4(fin, v, inf), vh = select4(fin, v, ninf);                  \
                l = select4(vl < l, vl, l);                                                 \
                h = select4(vh > h, vh, h);                                                 \
            }                                                                               \
        }                                                                                   \
        int64_t zs = z[0] + z[1] + z[2] + z[3], ns = nn[0] + nn[1] + nn[2] + nn[3];         \
        int64_t cs = c[0] + c[1] + c[2] + c[3];                                             \
        double p = (a1[0] + a1[1]) + (a1[2] + a1[3]), q = (a2[0] + a2[1]) + (a2[2] + a2[3]); \
        double lo_ = l[0], hi_ = h[0];                                                      \
        for (int j = 1; j < 4; j++) {                                                       \
            lo_ = l[j] < lo_ ? l[j] : lo_;                                                  \
            hi_ = h[j] > hi_ ? h[j] : hi_;                                                  \
        }                                                                                   \
        *zeros += zs; *nan += ns; *count += cs; *s1 += p; *s2 += q;                         \
        if (lo_ < *lo) *lo = lo_;                                                           \
        if (hi_ > *hi) *hi = hi_;                                                           \
        if (k < n) run_##T(base, off + k, n - k, 1, K, full, zeros, nan, count, s1, s2, lo, hi); \
    }
VRUN(f32, load_f32)
VRUN(f64, load_f64)
VRUN(f16, load_f16)
VRUN(bf16, load_bf16)

typedef void (*vrun_fn)(const char *, int64_t, int64_t, double, int, int64_t *, int64_t *, int64_t *,
                        double *, double *, double *, double *);

typedef void (*run_fn)(const char *, int64_t, int64_t, int64_t, double, int, int64_t *, int64_t *, int64_t *,
                       double *, double *, double *, double *);

/* dims: ndim sizes, then ndim strides (elements); ndim <= MAX_DIMS (the caller checks). mask_inner:
 * elements under one mask entry (the product of the dims the mask does not cover). */

/* The shift K: the lower median of the finite, unmasked values at the sampled positions (0 when none). */
double layertap_shift(const void *x, int dtype, int ndim, const int64_t *dims, const uint8_t *mask,
                      int64_t mask_inner) {
    const int64_t *sizes = dims, *strides = dims + ndim;
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++) numel *= sizes[d];
    double s[SAMPLE];
    int cnt = 0;
    int64_t m = numel < SAMPLE ? numel : SAMPLE;
    int64_t step = m > 0 ? numel / m : 1;
    for (int64_t j = 0; j < m; j++) {
        int64_t i = j * step;
        if (mask != NULL && !mask[i / mask_inner]) continue;
        double v = load((const char *)x, offset_of(i, ndim, sizes, strides), dtype);
        if (!isfinite(v)) continue;
        int k = cnt++;
        while (k > 0 && s[k - 1] > v) { s[k] = s[k - 1]; k--; }
        s[k] = v;
    }
    return cnt > 0 ? s[(cnt - 1) / 2] : 0.0;
}

/* Merges the statistics of logical elements [begin, end) into part (the row's layout, counts as
 * doubles: exact below 2^53). full == 0: zeros, NaN and the finite count only (a tap that keeps only
 * nonfinite on a pass it does not sample). Runs of the last dim go to the SIMD loop when contiguous. */
void layertap_partial(const void *x, int dtype, int ndim, const int64_t *dims, const uint8_t *mask,
                      int64_t mask_inner, int64_t begin, int64_t end, double K, int full, double *part) {
    if (begin >= end) return;  /* an empty tensor (a size-0 dim would divide by zero below) */
    const int64_t *sizes = dims, *strides = dims + ndim;
    run_fn run = dtype == F32 ? run_f32 : dtype == F64 ? run_f64 : dtype == F16 ? run_f16 : run_bf16;
    vrun_fn vrun = dtype == F32 ? vrun_f32 : dtype == F64 ? vrun_f64 : dtype == F16 ? vrun_f16 : vrun_bf16;
    const char *base = (const char *)x;
    int64_t zeros = 0, nan = 0, count = 0;
    double s1 = 0.0, s2 = 0.0, lo = INFINITY, hi = -INFINITY;
    int last = ndim - 1;
    int64_t inner = ndim > 0 ? sizes[last] : 1, inner_stride = ndim > 0 ? strides[last] : 0;
    int64_t idx[MAX_DIMS];
    int64_t rest = begin;
    for (int d = last; d >= 0; d--) { idx[d] = rest % sizes[d]; rest /= sizes[d]; }
    int64_t i = begin;
    while (i < end) {
        int64_t off = 0;
        for (int d = 0; d < last; d++) off += idx[d] * strides[d];
        int64_t k0 = ndim > 0 ? idx[last] : 0;
        int64_t len = inner - k0;
        if (end - i < len) len = end - i;
        int keep = 1;
        if (mask != NULL) {  /* a run never crosses a mask entry */
            int64_t p = i / mask_inner, left = (p + 1) * mask_inner - i;
            if (left < len) len = left;
            keep = mask[p] != 0;
        }
        if (keep) {
            if (inner_stride == 1)
                vrun(base, off + k0, len, K, full, &zeros, &nan, &count, &s1, &s2, &lo, &hi);
            else
                run(base, off + k0 * inner_stride, len, inner_stride, K, full, &zeros, &nan, &count, &s1, &s2, &lo,
                    &hi);
        }
        i += len;
        if (ndim == 0) break;
        idx[last] = k0 + len;
        for (int d = last; d > 0 && idx[d] >= sizes[d]; d--) {
            idx[d] = 0;
            idx[d - 1]++;
        }
    }
    part[0] += (double)zeros;
    part[1] += (double)nan;
    part[2] += (double)count;
    part[3] += s1;
    part[4] += s2;
    if (lo < part[6]) part[6] = lo;
    if (hi > part[7]) part[7] = hi;
}
