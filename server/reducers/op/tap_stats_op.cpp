// layertap::tap_stats's CPU kernel, registered with the dispatcher: a firing's call reaches the
// statistics loop (tap_stats.c) with no Python in between (about 1.3 us a call on the 2-vCPU VM,
// against 6 us through a Python kernel). Built at first use by op/cpu.py, against torch's headers.
// The flag: 0 skips the work, 2 counts zeros, NaN and finite values only, anything else does all.
// A large tensor is read in chunks on torch's intra-op threads, as inductor's kernel would be.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <vector>

extern "C" {
#include "tap_stats.c"
}

namespace {

//: Elements per task of the parallel loop: below twice this, one thread reads the tensor (a small
//: tensor's firing must not pay a thread handoff).
constexpr int64_t kGrain = 1 << 16;

int dtype_code(c10::ScalarType t) {
    switch (t) {
    case c10::ScalarType::Float: return F32;
    case c10::ScalarType::Double: return F64;
    case c10::ScalarType::Half: return F16;
    case c10::ScalarType::BFloat16: return BF16;
    default: return -1;
    }
}

// The dims the statistics loop walks: x's dims in storage order (the order of the statistics does not
// matter), size-1 dims dropped and neighbours that are one run in memory merged, so a contiguous or
// channels-last tensor is one long run whatever its shape. The first `lead` dims (the mask's) stay
// first and in order, as the mask is indexed by them; only the dims under it move. Returns the count.
int64_t walk_dims(const at::Tensor &x, int64_t lead, int64_t *dims) {
    int64_t nd = x.dim();
    std::vector<int64_t> order(static_cast<size_t>(nd));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin() + lead, order.end(),
                     [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
    int64_t sizes[MAX_DIMS], strides[MAX_DIMS], n = 0;
    bool last_lead = false;
    for (int64_t i = 0; i < nd; i++) {
        int64_t d = order[static_cast<size_t>(i)];
        bool is_lead = i < lead;
        if (x.size(d) == 1 && !is_lead) continue;
        // Merged only within one side of the mask's edge.
        if (n > 0 && is_lead == last_lead && strides[n - 1] == x.stride(d) * x.size(d)) {
            sizes[n - 1] *= x.size(d);
            strides[n - 1] = x.stride(d);
        } else {
            sizes[n] = x.size(d);
            strides[n] = x.stride(d);
            n++;
        }
        last_lead = is_lead;
    }
    for (int64_t i = 0; i < n; i++) {
        dims[i] = sizes[i];
        dims[n + i] = strides[i];
    }
    return n;
}

void tap_stats_cpu(const at::Tensor &given, const at::Tensor &out, const at::Tensor &row, const at::Tensor &flag,
                   const std::optional<at::Tensor> &mask) {
    // A view with the negative bit (a complex tensor's conj().imag) reads its memory negated: resolved first.
    const at::Tensor x = given.is_neg() ? given.resolve_neg() : given;
    int code = dtype_code(x.scalar_type());
    TORCH_CHECK_VALUE(code >= 0 && x.layout() == c10::kStrided,
                      "tap_stats: x must be a strided float tensor (float32, float64, float16, bfloat16), got ",
                      x.scalar_type());
    TORCH_CHECK_VALUE(out.scalar_type() == c10::ScalarType::Double && out.dim() == 2 && out.size(1) == 8 &&
                          out.is_contiguous(),
                      "tap_stats: out must be a contiguous (rows, 8) float64 tensor, got ", out.scalar_type(), " ",
                      out.sizes());
    TORCH_CHECK_VALUE(row.scalar_type() == c10::ScalarType::Long && row.numel() == 1,
                      "tap_stats: row must be one int64 element, got ", row.scalar_type(), " ", row.sizes());
    TORCH_CHECK_VALUE(flag.scalar_type() == c10::ScalarType::Int && flag.numel() == 1,
                      "tap_stats: flag must be one int32 element, got ", flag.scalar_type(), " ", flag.sizes());
    TORCH_CHECK_VALUE(x.is_cpu() && out.is_cpu() && row.is_cpu() && flag.is_cpu() && (!mask || mask->is_cpu()),
                      "tap_stats: every tensor must be on one device, got x on ", x.device(), ", out on ",
                      out.device(), ", row on ", row.device(), ", flag on ", flag.device());
    const uint8_t *keep = nullptr;
    int64_t inner = 1;
    if (mask) {
        const at::Tensor &m = *mask;
        bool fits = (m.scalar_type() == c10::ScalarType::Bool || m.scalar_type() == c10::ScalarType::Byte) &&
                    m.is_contiguous() && m.dim() <= x.dim();
        for (int64_t d = 0; fits && d < m.dim(); d++) fits = m.size(d) == x.size(d);
        TORCH_CHECK_VALUE(fits, "tap_stats: mask must be a contiguous bool or uint8 tensor of x's leading dims, got ",
                          m.scalar_type(), " ", m.sizes(), " for x of ", x.sizes());
        keep = static_cast<const uint8_t *>(m.data_ptr());
        inner = m.numel() ? x.numel() / m.numel() : 1;
    }
    int64_t nd = x.dim();
    TORCH_CHECK_VALUE(nd <= MAX_DIMS, "tap_stats: x has ", nd, " dims, at most ", MAX_DIMS, " are read");
    int64_t dims[2 * MAX_DIMS];
    for (int64_t d = 0; d < nd; d++) {
        dims[d] = x.size(d);
        dims[nd + d] = x.stride(d);
    }
    int64_t at_row = *row.data_ptr<int64_t>();  // a CPU tensor: reading it is no sync
    TORCH_CHECK_VALUE(at_row >= 0 && at_row < out.size(0), "tap_stats: row is not a row of out (", out.size(0),
                      " rows)");
    int32_t mode = *flag.data_ptr<int32_t>();
    if (mode == 0) return;  // the tap is off this pass: the same call, no work
    bool full = mode != 2;  // 2: zeros, NaN and the finite count only (nonfinite on an unsampled pass)
    const void *data = x.data_ptr();
    double k = full ? layertap_shift(data, code, static_cast<int>(nd), dims, keep, inner) : 0.0;
    int64_t walk[2 * MAX_DIMS];
    int wd = static_cast<int>(walk_dims(x, mask ? mask->dim() : 0, walk));
    int64_t numel = x.numel();
    std::vector<double> parts;
    auto identity = [](double *p) {
        for (int j = 0; j < 6; j++) p[j] = 0.0;
        p[6] = INFINITY;
        p[7] = -INFINITY;
    };
    if (numel >= 2 * kGrain && at::get_num_threads() > 1) {
        // torch's own pool (torch.set_num_threads), in chunks merged after: each chunk's sums are exact
        // partial sums, so the result differs from one thread's only in float64 rounding.
        int64_t chunks = (numel + kGrain - 1) / kGrain;
        parts.assign(static_cast<size_t>(chunks) * 8, 0.0);
        for (int64_t c = 0; c < chunks; c++) identity(&parts[c * 8]);
        at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
            for (int64_t c = b; c < e; c++)
                layertap_partial(data, code, wd, walk, keep, inner, c * kGrain,
                                 std::min(numel, (c + 1) * kGrain), k, full, &parts[c * 8]);
        });
    } else {
        parts.assign(8, 0.0);
        identity(parts.data());
        layertap_partial(data, code, wd, walk, keep, inner, 0, numel, k, full, parts.data());
    }
    double *r = out.data_ptr<double>() + at_row * 8;
    for (size_t c = 0; c < parts.size(); c += 8) {
        for (int j = 0; j < 5; j++) r[j] += parts[c + j];
        if (parts[c + 6] < r[6]) r[6] = parts[c + 6];
        if (parts[c + 7] > r[7]) r[7] = parts[c + 7];
    }
    if (full) r[5] = k;
}

}  // namespace

TORCH_LIBRARY_IMPL(layertap, CPU, m) { m.impl("tap_stats", &tap_stats_cpu); }
