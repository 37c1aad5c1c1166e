// eyas::row_gemv: one input row times bf16 weights on x86 CPUs, at the memory bandwidth.
//
// A decoding step multiplies one row by every weight matrix once, so its products are reads of the weights. At one
// row, on a 2-core Xeon reading ~30 GB/s, oneDNN's bf16 product reads a weight at ~21 GB/s and inductor's GEMM
// template at ~24 (kernels shaped for many rows), and on CPUs without bf16 instructions torch's one-row bf16 product
// is slower than fp32's although it reads half the bytes; this one streams each weight once with prefetches far
// enough ahead to hide the DRAM latency (25-31 GB/s on one large weight, 27 on the lm_head, ~25 on a model's weights
// one after another: docs/design/cpu-kernels.md), and takes several weights that share the input in one call (q/k/v,
// gate/up), so they share one parallel region and no weight is concatenated or copied.
//
// One source, built for the machine's vector instructions (row_gemv.py passes the -m flags and names the library by
// them): AVX512-BF16 multiplies bf16 pairs directly; AVX-512 and AVX2 widen each bf16 to fp32 (a shift: bf16 is the
// high half of an fp32) and use fp32 FMAs, which at one row cost far less than the weight's read.
//
//   x [..., K] holding one row (bf16), weights: [N_i, K] contiguous bf16  ->  [..., sum N_i] bf16 (fp32 accumulation)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// A step over kLanes bf16 of a weight row and of x: `load_x` once per step (shared by the block's rows), `fma` per
// row into that row's accumulator, `sum` at the end. With AVX512-BF16 the pairs are multiplied directly; otherwise
// a step is split into the elements at even and odd places, each widened to fp32 (a shift or a mask of the same
// load, no shuffle: a dot product does not care which pairs with which as long as w and x are split alike).
#if defined(__AVX512F__)
using V = __m512;
using VI = __m512i;
constexpr int64_t kLanes = 32;
inline V zero() { return _mm512_setzero_ps(); }
inline VI load(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V even(VI v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline V odd(VI v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xffff0000))); }
inline float reduce(V v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
using V = __m256;
using VI = __m256i;
constexpr int64_t kLanes = 16;
inline V zero() { return _mm256_setzero_ps(); }
inline VI load(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V even(VI v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline V odd(VI v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xffff0000))); }
inline float reduce(V v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#else
#error "eyas::row_gemv is built with -mavx512bf16, -mavx512f or -mavx2 -mfma (row_gemv.py picks them)"
#endif

#if defined(__AVX512BF16__)
struct X { __m512bh v; };
struct Acc { V v = zero(); };
inline X load_x(const uint16_t* x) { return {(__m512bh)load(x)}; }
inline void fma(Acc& a, const uint16_t* w, const X& x) { a.v = _mm512_dpbf16_ps(a.v, (__m512bh)load(w), x.v); }
inline float sum(const Acc& a) { return reduce(a.v); }
#else
struct X { V even, odd; };
struct Acc { V even = zero(), odd = zero(); };
inline X load_x(const uint16_t* x) {
  const VI v = load(x);
  return {even(v), odd(v)};
}
inline void fma(Acc& a, const uint16_t* w, const X& x) {
  const VI v = load(w);
  a.even = fmadd(even(v), x.even, a.even);
  a.odd = fmadd(odd(v), x.odd, a.odd);
}
inline float sum(const Acc& a) { return reduce(a.even) + reduce(a.odd); }
#endif

constexpr int64_t kBlock = 2;        // weight rows per inner block: independent accumulator chains
constexpr int64_t kAhead = 9216;     // bytes prefetched ahead of the stream (into L2): ~DRAM latency x bandwidth
constexpr int64_t kChunkBytes = 1 << 16;  // the least weight bytes one thread takes, so small weights stay on one

// out[r] = dot(w[r*K : (r+1)*K], x) for r < rows (rows <= kBlock); the tail of K (under kLanes) is read from
// zero-padded copies, so every ISA takes it alike.
inline void dot_block(const uint16_t* w, const uint16_t* x, int64_t K, int64_t rows, float* out) {
  Acc acc[kBlock];
  const char* ahead = reinterpret_cast<const char*>(w) + kAhead;
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    const X xv = load_x(x + k);
    for (int64_t r = 0; r < rows; ++r) {
      _mm_prefetch(ahead + 2 * (r * K + k), _MM_HINT_T1);
      fma(acc[r], w + r * K + k, xv);
    }
  }
  if (k < K) {
    uint16_t xt[kLanes] = {}, wt[kLanes] = {};
    std::memcpy(xt, x + k, 2 * (K - k));
    const X xv = load_x(xt);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(wt, w + r * K + k, 2 * (K - k));
      fma(acc[r], wt, xv);
    }
  }
  for (int64_t r = 0; r < rows; ++r) out[r] = sum(acc[r]);
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
