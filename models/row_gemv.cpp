// eyas::row_gemv: one input row times bf16 weights on CPUs with AVX512-BF16, at the memory bandwidth.
//
// A decoding step multiplies one row by every weight matrix once, so its products are reads of the weights. At one
// row, on a 2-core Xeon reading ~30 GB/s, oneDNN's bf16 product reads a weight at ~21 GB/s and inductor's GEMM
// template at ~24 (kernels shaped for many rows); this one streams each weight once with prefetches far enough ahead
// to hide the DRAM latency (25-31 GB/s on one large weight, 27 on the lm_head, ~25 on a model's weights one after
// another: docs/design/cpu-kernels.md), and takes several weights that share the input in one call (q/k/v,
// gate/up), so they share one parallel region and no weight is concatenated or copied.
//
//   x [..., K] holding one row (bf16), weights: [N_i, K] contiguous bf16  ->  [..., sum N_i] bf16 (fp32 accumulation)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 2;        // weight rows per inner block: two independent accumulator chains
constexpr int64_t kAhead = 9216;     // bytes prefetched ahead of the stream (into L2): ~DRAM latency x bandwidth
constexpr int64_t kChunkBytes = 1 << 16;  // the least weight bytes one thread takes, so small weights stay on one

// out[r] = dot(w[r*K : (r+1)*K], x) for r < rows (rows <= kBlock); the tail of K is read with a masked load.
__attribute__((target("avx512f,avx512bw,avx512bf16")))
inline void dot_block(const uint16_t* w, const uint16_t* x, int64_t K, int64_t rows, float* out) {
  __m512 acc[kBlock];
  for (int64_t r = 0; r < kBlock; ++r) acc[r] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(w) + kAhead;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
    for (int64_t r = 0; r < rows; ++r) {
      _mm_prefetch(ahead + 2 * (r * K + k), _MM_HINT_T1);
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w + r * K + k), xv);
    }
  }
  if (k < K) {
    const __mmask32 tail = (__mmask32)((1ull << (K - k)) - 1);
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + k);
    for (int64_t r = 0; r < rows; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, w + r * K + k), xv);
  }
  for (int64_t r = 0; r < rows; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

at::Tensor row_gemv(const at::Tensor& x, at::TensorList weights) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, "eyas::row_gemv: x must be bf16 on CPU");
  const int64_t K = x.size(-1);
  TORCH_CHECK(x.numel() == K, "eyas::row_gemv: x must hold one row, got ", x.sizes());
  TORCH_CHECK(!weights.empty(), "eyas::row_gemv: no weights");
  std::vector<int64_t> first_block{0};  // per weight: its first block in the blocks of all weights
  std::vector<int64_t> first_out{0};    // per weight: its first output column
  std::vector<const uint16_t*> data;    // per weight: its first element
  for (const auto& w : weights) {
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.size(1) == K &&
                    w.is_contiguous(),
                "eyas::row_gemv: weights must be contiguous bf16 [N, ", K, "] on CPU, got ", w.sizes());
    first_block.push_back(first_block.back() + (w.size(0) + kBlock - 1) / kBlock);
    first_out.push_back(first_out.back() + w.size(0));
    data.push_back(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()));
  }
  auto sizes = x.sizes().vec();
  sizes.back() = first_out.back();
  at::Tensor y = at::empty(sizes, x.options());
  const at::Tensor xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t grain = std::max<int64_t>(1, kChunkBytes / (kBlock * K * 2));
  at::parallel_for(0, first_block.back(), grain, [&](int64_t begin, int64_t end) {
    size_t i = 0;
    float out[kBlock];
    for (int64_t b = begin; b < end; ++b) {
      while (b >= first_block[i + 1]) ++i;
      const int64_t row = (b - first_block[i]) * kBlock;
      const int64_t rows = std::min<int64_t>(kBlock, first_out[i + 1] - first_out[i] - row);
      dot_block(data[i] + row * K, xp, K, rows, out);
      for (int64_t r = 0; r < rows; ++r) yp[first_out[i] + row + r] = at::BFloat16(out[r]);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(eyas, m) { m.def("row_gemv(Tensor x, Tensor[] weights) -> Tensor"); }

TORCH_LIBRARY_IMPL(eyas, CPU, m) { m.impl("row_gemv", &row_gemv); }
