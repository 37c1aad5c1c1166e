// eyas's CPU kernels for a decoding step's few rows, built together for the machine's vector instructions:
// eyas::row_gemv, one input row or a few times bf16 or fp32 weights at the memory bandwidth, and eyas::attend (below),
// the attention of a few query rows over the cache.
//
// A decoding step multiplies one row by every weight matrix once, so its products are reads of the weights. torch's
// products are shaped for many rows: at one row they read a weight well below the bandwidth (oneDNN's bf16 product
// and inductor's GEMM templates 70-80 % of it on a 2-core Xeon; on CPUs without bf16 instructions torch's one-row
// bf16 product is slower than fp32's although it reads half the bytes). This one reads each thread's share of the
// rows as several far-apart streams at once, each with prefetches ahead (docs/design/cpu-kernels.md), and takes
// several weights that share the input in one call (q/k/v, gate/up), so they share one parallel region and no weight
// is concatenated or copied. A verify's few rows read each weight row from memory once, for the first block of them
// (up to four rows, each weight vector loaded once for the block); the next blocks find it in the cache, the second
// prefetching the rows read next, so a few rows cost the read and their FMAs overlap it.
//
// One source, built for the machine's vector instructions (row_gemv.py passes the -m flags and names the library by
// them): AVX512-BF16 multiplies bf16 pairs directly; AVX-512 and AVX2 widen each bf16 to fp32 (a shift: bf16 is the
// high half of an fp32) and use fp32 FMAs, which at one row cost far less than the weight's read. fp32 weights take
// fp32 FMAs on every build.
//
//   x [..., K] holding M rows (M > kMaxRows: at::linear), weights: [N_i, K] contiguous, x's dtype  ->  [..., sum N_i]
//   (fp32 accumulation)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/SmallVector.h>
#include <immintrin.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

// Per instruction set: the vector of fp32 (V) and of raw bits (VI), kLanes bf16 (or kLanes / 2 fp32) to a vector,
// and the few operations the dot products below are written in. A bf16 vector is split into its elements at even
// and odd places, each widened to fp32 (a shift or a mask of the same load, no shuffle: a dot product does not care
// which pairs with which as long as w and x are split alike).
#if defined(__AVX512F__)
using V = __m512;
using VI = __m512i;
constexpr int64_t kLanes = 32;
inline V zero() { return _mm512_setzero_ps(); }
inline VI load(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline V loadf(const float* p) { return _mm512_loadu_ps(p); }
inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V even(VI v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline V odd(VI v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xffff0000))); }
inline float reduce(V v) { return _mm512_reduce_add_ps(v); }
inline V widen(const uint16_t* p) {  // kLanes / 2 bf16, in order
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline V set1(float a) { return _mm512_set1_ps(a); }
inline void storef(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V maxf(V a, V b) { return _mm512_max_ps(a, b); }
inline V addf(V a, V b) { return _mm512_add_ps(a, b); }
inline V subf(V a, V b) { return _mm512_sub_ps(a, b); }
inline V mulf(V a, V b) { return _mm512_mul_ps(a, b); }
inline V roundf_(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V pow2(V n) {  // 2^n for integral n in the normal range
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline __m256 halves(V v) {  // its two 256-bit halves added
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
using V = __m256;
using VI = __m256i;
constexpr int64_t kLanes = 16;
inline V zero() { return _mm256_setzero_ps(); }
inline VI load(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline V loadf(const float* p) { return _mm256_loadu_ps(p); }
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V even(VI v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline V odd(VI v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xffff0000))); }
inline float reduce(V v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
inline V widen(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline V set1(float a) { return _mm256_set1_ps(a); }
inline void storef(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V maxf(V a, V b) { return _mm256_max_ps(a, b); }
inline V addf(V a, V b) { return _mm256_add_ps(a, b); }
inline V subf(V a, V b) { return _mm256_sub_ps(a, b); }
inline V mulf(V a, V b) { return _mm256_mul_ps(a, b); }
inline V roundf_(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V pow2(V n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline __m256 halves(V v) { return v; }
#else
#error "eyas::row_gemv is built with -mavx512bf16, -mavx512f or -mavx2 -mfma (row_gemv.py picks them)"
#endif

// The sums of four vectors into out[0..3]: one shuffle tree for the four, a quarter of four reductions' work.
inline void reduce4(V a, V b, V c, V d, float* out) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(halves(a), halves(b)), _mm256_hadd_ps(halves(c), halves(d)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

// How a step of one vector register's width over a weight row of element type T loads x (`load_x`) and the weight
// (`load_w`), once each per step, and accumulates their product (`fma`); `sum4` reduces four accumulators at the
// end, each by the same tree whatever the others hold.
// `block`: the input rows one pass over the weight rows takes at once, each weight vector loaded once for all of them:
// as many as keep kStreams accumulators per row, the weight and the rows' x in the ISA's registers (32 with AVX-512,
// 16 with AVX2; widened bf16 takes two of each).
template <typename T>
struct Dot;

template <>
struct Dot<float> {
  static constexpr int64_t lanes = kLanes / 2;
  static constexpr int64_t block = kLanes == 32 ? 4 : 2;
  struct X { V v; };
  using W = X;
  struct Acc { V v = zero(); };
  static X load_x(const float* x) { return {loadf(x)}; }
  static W load_w(const float* w) { return {loadf(w)}; }
  static void fma(Acc& a, const W& w, const X& x) { a.v = fmadd(w.v, x.v, a.v); }
  static void sum4(const Acc* a, float* out) { reduce4(a[0].v, a[1].v, a[2].v, a[3].v, out); }
};

template <>
struct Dot<uint16_t> {  // bf16
  static constexpr int64_t lanes = kLanes;
#if defined(__AVX512BF16__)
  static constexpr int64_t block = 4;
  struct X { __m512bh v; };
  using W = X;
  struct Acc { V v = zero(); };
  static X load_x(const uint16_t* x) { return {(__m512bh)load(x)}; }
  static W load_w(const uint16_t* w) { return {(__m512bh)load(w)}; }
  static void fma(Acc& a, const W& w, const X& x) { a.v = _mm512_dpbf16_ps(a.v, w.v, x.v); }
  static void sum4(const Acc* a, float* out) { reduce4(a[0].v, a[1].v, a[2].v, a[3].v, out); }
#else
  static constexpr int64_t block = kLanes == 32 ? 2 : 1;
  struct X { V even, odd; };
  using W = X;
  struct Acc { V even = zero(), odd = zero(); };
  static X load_x(const uint16_t* x) {
    const VI v = load(x);
    return {even(v), odd(v)};
  }
  static W load_w(const uint16_t* w) { return load_x(w); }
  static void fma(Acc& a, const W& w, const X& x) {
    a.even = fmadd(w.even, x.even, a.even);
    a.odd = fmadd(w.odd, x.odd, a.odd);
  }
  static void sum4(const Acc* a, float* out) {
    reduce4(addf(a[0].even, a[0].odd), addf(a[1].even, a[1].odd), addf(a[2].even, a[2].odd),
            addf(a[3].even, a[3].odd), out);
  }
#endif
};

// A thread reads its share of the rows as kStreams runs of consecutive rows, far apart, a row of each at a time: one
// sequential stream per core leaves the memory system idle between its requests, several keep more of them in flight
// (a 2-core Ice Lake Xeon reads ~19 GB/s as one stream a core, ~24 as four or eight). With the weights in huge pages
// (weight_arena.py) more than four streams, or more than ~2.5 KB a thread in flight, only queue misses behind each
// other: a 2-core Zen 4 EPYC reads a SmolLM2-135M step's bf16 products 1.06x (at 35 GB/s) to 1.15x (at 53 GB/s)
// faster as four streams 640 B ahead than as eight 1280 B ahead (benchmarks/kernel_variants.py).
constexpr int64_t kStreams = 4;
constexpr int64_t kAhead = 640;           // bytes prefetched ahead of each stream
// How the first pass prefetches (its rows are read once a step). Non-temporal on the AVX2 build: a 2-core Zen 3 EPYC
// ran compiled steps 1.012-1.019x faster in bf16 and 1.012x in fp32 than with T1 prefetches (in-step A/Bs), the
// products alone at the same rate. Into L2 on the AVX-512 builds: a 2-core Zen 4 EPYC ran a bf16 step 0.918x as fast
// with non-temporal prefetches, measured on an earlier version of this kernel (docs/design/cpu-kernels.md).
#if defined(__AVX512F__)
constexpr auto kFirstPassHint = _MM_HINT_T1;
#else
constexpr auto kFirstPassHint = _MM_HINT_NTA;
#endif
constexpr int64_t kChunkBytes = 1 << 16;  // the least weight bytes one thread takes, so small weights stay on one
// The most input rows the kernel takes: past a few dozen a product is no longer a read of the weights, and torch's
// blocked GEMMs win; a call with more (a graph whose row count varies) hands them to at::linear.
constexpr int64_t kMaxRows = 32;

// What a pass over the weight rows prefetches: ahead in the rows it reads (they come from memory: the first pass), the
// rows each stream reads next (the second pass, so their reads overlap the FMAs of the rest of the input rows), or
// nothing (its rows and the next are in the cache already).
enum Prefetch { kNone, kThis, kNext };

// out[r * kStreams + s] = dot(w[s][0:K], x[r]) for s < n (n <= kStreams) and each of the R rows of x (K apart); the
// tail of K (under a step) is read from zero-padded copies, so every ISA takes it alike. Full groups (n == kStreams,
// the common case) pass n as a constant, so the accumulators stay in registers. Each output is the same FMAs in the
// same order whatever R is.
template <typename T, Prefetch P, int64_t R, int64_t Fixed = 0>
inline void dots(const T* const* w, const T* x, int64_t K, int64_t n_, float* out) {
  const int64_t n = Fixed ? Fixed : n_;
  using D = Dot<T>;
  typename D::Acc acc[R][kStreams];
  typename D::X xv[R];
  int64_t k = 0;
  for (; k + D::lanes <= K; k += D::lanes) {
    for (int64_t r = 0; r < R; ++r) xv[r] = D::load_x(x + r * K + k);
    for (int64_t s = 0; s < n; ++s) {
      if constexpr (P == kThis) _mm_prefetch(reinterpret_cast<const char*>(w[s] + k) + kAhead, kFirstPassHint);
      if constexpr (P == kNext) _mm_prefetch(reinterpret_cast<const char*>(w[s] + K + k), _MM_HINT_T1);
      const auto wv = D::load_w(w[s] + k);
      for (int64_t r = 0; r < R; ++r) D::fma(acc[r][s], wv, xv[r]);
    }
  }
  if (k < K) {
    T xt[D::lanes] = {}, wt[D::lanes] = {};
    for (int64_t r = 0; r < R; ++r) {
      std::memcpy(xt, x + r * K + k, sizeof(T) * (K - k));
      xv[r] = D::load_x(xt);
    }
    for (int64_t s = 0; s < n; ++s) {
      std::memcpy(wt, w[s] + k, sizeof(T) * (K - k));
      const auto wv = D::load_w(wt);
      for (int64_t r = 0; r < R; ++r) D::fma(acc[r][s], wv, xv[r]);
    }
  }
  static_assert(kStreams == 4, "dots reduces its accumulators four at a time");
  for (int64_t r = 0; r < R; ++r) D::sum4(acc[r], out + r * kStreams);  // a short group's unused ones hold zeros
}

// The next rows of x (`left` of them) against the weight rows w: as many as one pass takes (Dot<T>::block, else 2,
// else 1); returns how many it took.
template <typename T, Prefetch P>
inline int64_t dots_block(const T* const* w, const T* x, int64_t K, int64_t n, int64_t left, float* out) {
  auto take = [&](auto rows) {
    constexpr int64_t R = decltype(rows)::value;
    if (n == kStreams)
      dots<T, P, R, kStreams>(w, x, K, n, out);
    else
      dots<T, P, R>(w, x, K, n, out);
    return R;
  };
  constexpr int64_t B = Dot<T>::block;
  if (left >= B) return take(std::integral_constant<int64_t, B>{});
  if constexpr (B > 2)
    if (left >= 2) return take(std::integral_constant<int64_t, 2>{});
  return take(std::integral_constant<int64_t, 1>{});
}

// A thread's share of the rows, [begin, end), read as kStreams runs of `run` consecutive rows; step j reads row j of
// each run. Its thread takes steps from the front, a few at a time (`next`: steps before it are claimed); a thread done
// with its own share takes the back half of what is left of another's (lowering `limit`: steps from it on are taken).
// The two cores of a shared host read at different rates (one ~15 % slower for seconds at a time on a 2-core Zen 4
// EPYC), so equal shares left the faster waiting at the end of every product; this way they finish together.
// Claims and cuts see each other through sequentially consistent operations: the owner publishes its claim, then
// reads the limit; a thief lowers the limit, then reads the claim, and starts after both (see `take_back`).
struct alignas(64) Share {
  std::atomic<int64_t> next{0}, limit{0};
  int64_t begin = 0, end = 0, run = 0;
};

// Bytes of weight rows a claim of steps covers at least: its two atomic operations cost well under 1 % of reading
// them, and the threads end at most about one claim apart.
constexpr int64_t kClaimBytes = 1 << 16;

// A call keeps its bookkeeping on the stack (the shares, the weights' first elements and rows, the output's sizes). A
// step makes ~150 calls, on caches its weight reads have left cold: the heap allocations of the first three cost 0.6 %
// of a compiled bf16 SmolLM2-135M step.
constexpr int64_t kLocalShares = 8;                 // machines of up to 8 threads allocate no shares
using Pointers = c10::SmallVector<const void*, 8>;  // per weight: its first element
using Rows = c10::SmallVector<int64_t, 9>;          // per weight: the rows before it; then all the rows

// y[m][r] = dot(row r of the weights one after another, x[m]) for every row r of them and each of the M input rows;
// T the element type (data[i]: weight i's first element), Out y's. Each weight row is read from memory once, for the first block of input rows; the
// others take it from the cache (kStreams rows of K, a few KB), so a verify of a few tokens reads the weights once as
// a step does, and its FMAs load each weight vector once per block of rows. Which thread computes a row does not
// change its sums.
template <typename T, typename Out>
void products(const T* x, int64_t M, c10::ArrayRef<const void*> data, c10::ArrayRef<int64_t> first_row,
              int64_t K, Out* y) {
  const int64_t N = first_row.back();
  const int64_t grain = std::max<int64_t>(1, kChunkBytes / (K * int64_t(sizeof(T))));
  const int64_t claim = std::max<int64_t>(1, kClaimBytes / (kStreams * K * int64_t(sizeof(T))));
  const int64_t count = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (N + grain - 1) / grain));
  Share local[kLocalShares];
  std::unique_ptr<Share[]> more(count > kLocalShares ? new Share[count] : nullptr);
  Share* const shares = more ? more.get() : local;
  for (int64_t i = 0; i < count; ++i) {
    Share& sh = shares[i];
    sh.begin = N * i / count;
    sh.end = N * (i + 1) / count;
    sh.run = (sh.end - sh.begin + kStreams - 1) / kStreams;
    sh.limit.store(sh.run, std::memory_order_relaxed);
  }
  // steps [j0, j1) of a share
  auto steps = [&](const Share& sh, int64_t j0, int64_t j1) {
    size_t weight[kStreams] = {};  // per stream: the weight its row is in
    for (int64_t j = j0; j < j1; ++j) {
      const T* rows[kStreams];
      int64_t at[kStreams];
      int64_t n = 0;
      for (; n < kStreams && sh.begin + n * sh.run + j < sh.end; ++n) {
        at[n] = sh.begin + n * sh.run + j;
        while (at[n] >= first_row[weight[n] + 1]) ++weight[n];
        rows[n] = static_cast<const T*>(data[weight[n]]) + (at[n] - first_row[weight[n]]) * K;
      }
      float out[Dot<T>::block * kStreams];
      for (int64_t m = 0, pass = 0; m < M; ++pass) {
        const int64_t r = pass == 0   ? dots_block<T, kThis>(rows, x, K, n, M, out)
                          : pass == 1 ? dots_block<T, kNext>(rows, x + m * K, K, n, M - m, out)
                                      : dots_block<T, kNone>(rows, x + m * K, K, n, M - m, out);
        for (int64_t i = 0; i < r; ++i)
          for (int64_t s = 0; s < n; ++s) y[(m + i) * N + at[s]] = Out(out[i * kStreams + s]);
        m += r;
      }
    }
  };
  // the owner: claims from the front until it meets the limit
  auto own = [&](Share& sh) {
    for (int64_t j = 0;;) {
      const int64_t want = j + claim;
      sh.next.store(want);
      const int64_t stop = std::min(want, sh.limit.load());
      if (j >= stop) return;
      steps(sh, j, stop);
      j = stop;
    }
  };
  // a thief: the back half of what is left of the share with most left, while that is at least two claims
  // (a thread's own shares have none left once `own` returns: its last claim passed their limit)
  auto take_back = [&]() {
    for (;;) {
      Share* most = nullptr;
      int64_t left = 2 * claim - 1;
      for (Share* sh = shares; sh != shares + count; ++sh) {
        const int64_t l = sh->limit.load(std::memory_order_relaxed) - sh->next.load(std::memory_order_relaxed);
        if (l > left) most = sh, left = l;
      }
      if (!most) return;
      int64_t limit = most->limit.load();
      const int64_t cut = limit - (limit - most->next.load()) / 2;
      if (cut >= limit || !most->limit.compare_exchange_strong(limit, cut)) continue;
      // the owner stops before `cut` unless it had claimed past it before the cut: then after its claim
      const int64_t from = std::max(cut, most->next.load());
      steps(*most, from, std::max(from, limit));
    }
  };
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) own(shares[i]);
    take_back();
  });
}

// y = x times weights laid out one after another in their rows: data[i] the first element of weight i, whose rows are
// first_row[i] .. first_row[i + 1] of all of them (K elements each, contiguous, x's dtype).
at::Tensor gemv(const at::Tensor& x, c10::ArrayRef<const void*> data, c10::ArrayRef<int64_t> first_row) {
  const int64_t K = x.size(-1);
  c10::DimVector sizes(x.sizes());
  sizes.back() = first_row.back();
  at::Tensor y = at::empty(sizes, x.options());
  const at::Tensor xc = x.contiguous();
  if (x.scalar_type() == at::kFloat)
    products(xc.data_ptr<float>(), xc.numel() / K, data, first_row, K, y.data_ptr<float>());
  else
    products(reinterpret_cast<const uint16_t*>(xc.data_ptr()), xc.numel() / K, data, first_row, K,
             y.data_ptr<at::BFloat16>());
  return y;
}

// x's dtype and rows, checked as both forms of the op take them; returns K.
int64_t check_rows(const at::Tensor& x, const char* op) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && (dtype == at::kBFloat16 || dtype == at::kFloat), op,
              ": x must be bf16 or fp32 on CPU");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K > 0 && x.numel() >= K, op, ": x must hold at least one row, got ", x.sizes());
  return K;
}

// Past kMaxRows rows: torch's products of the weights, concatenated.
at::Tensor linears(const at::Tensor& x, at::TensorList weights) {
  std::vector<at::Tensor> parts;
  for (const auto& w : weights) parts.push_back(at::linear(x, w));
  return at::cat(parts, -1);
}

at::Tensor row_gemv(const at::Tensor& x, at::TensorList weights) {
  const int64_t K = check_rows(x, "eyas::row_gemv");
  TORCH_CHECK(!weights.empty(), "eyas::row_gemv: no weights");
  Rows first_row{0};  // per weight: its first row in the rows of all weights (its first output)
  Pointers data;
  for (const auto& w : weights) {
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == x.scalar_type() && w.dim() == 2 && w.size(1) == K &&
                    w.is_contiguous(),
                "eyas::row_gemv: weights must be contiguous [N, ", K, "] on CPU in x's dtype (", x.scalar_type(),
                "), got ", w.scalar_type(), " ", w.sizes());
    first_row.push_back(first_row.back() + w.size(0));
    data.push_back(w.data_ptr());
  }
  return x.numel() / K > kMaxRows ? linears(x, weights) : gemv(x, data, first_row);
}

// The same product, each weight given by where it lies in `arena` (1-D uint8, the buffer that holds a model's weights:
// weight_arena.py): weight i is [rows[i], K] in x's dtype from byte offsets[i] on. A compiled step then takes one
// tensor for all its weights, not one per weight (each tensor a graph takes costs its call ~0.5-1 us).
at::Tensor row_gemv_at(const at::Tensor& x, const at::Tensor& arena, at::IntArrayRef offsets, at::IntArrayRef rows) {
  const int64_t K = check_rows(x, "eyas::row_gemv_at");
  TORCH_CHECK(arena.device().is_cpu() && arena.scalar_type() == at::kByte && arena.dim() == 1 &&
                  arena.is_contiguous(),
              "eyas::row_gemv_at: the arena must be a contiguous 1-D uint8 tensor on CPU");
  TORCH_CHECK(!offsets.empty() && offsets.size() == rows.size(),
              "eyas::row_gemv_at: one offset and one row count per weight, got ", offsets.size(), " and ", rows.size());
  const int64_t row_bytes = K * x.element_size();
  Rows first_row{0};
  Pointers data;
  for (size_t i = 0; i < offsets.size(); ++i) {
    TORCH_CHECK(rows[i] > 0 && offsets[i] >= 0 && offsets[i] + rows[i] * row_bytes <= arena.numel() &&
                    offsets[i] % x.element_size() == 0,
                "eyas::row_gemv_at: weight ", i, " ([", rows[i], ", ", K, "] at byte ", offsets[i],
                ") does not lie in the arena of ", arena.numel(), " bytes");
    first_row.push_back(first_row.back() + rows[i]);
    data.push_back(static_cast<const uint8_t*>(arena.data_ptr()) + offsets[i]);
  }
  if (x.numel() / K <= kMaxRows) return gemv(x, data, first_row);
  std::vector<at::Tensor> weights;
  for (size_t i = 0; i < offsets.size(); ++i)
    weights.push_back(arena.narrow(0, offsets[i], rows[i] * row_bytes).view(x.scalar_type()).view({rows[i], K}));
  return linears(x, weights);
}

// ---- eyas::attend: the attention of a few query rows over a cache ----------------------------------------------------
//
// A decoding step's attention is a few thousand multiply-adds per head over keys and values already in the cache.
// torch's CPU flash attention is built for blocks of many query rows: at one row it costs ~50 us a layer over 200
// cached tokens (most of it per-head GEMV calls and block set-up), and over bf16 on CPUs without bf16 units it runs
// MKL's emulated bf16 products (~5x that). This reads the keys and values in place in their dtype (no fp32 copy of the
// cache), computes in fp32, one (batch, key/value head, query row) at a time for the query heads that share that
// key/value head (a GQA group: each key and value row is read and widened once for all of them), each a dot product
// per key, a softmax and a weighted sum of the values.
//
//   q [B, H, T, D], k / v [B, G, S, D] (H a multiple of G: query head h reads key head h / (H / G); last dim
//   contiguous), mask None or additive [B|1, H|1, T, S] (float of any width, or bool: True = seen), scale
//   ->  [B, H, T, D] in q's dtype, laid out [B, T, H, D] as torch's CPU flash attention lays out its output.
//   A query row that sees no key gets zeros.

inline V widen(const float* p) { return loadf(p); }

// e^x for x <= 0 (scores minus their max), to ~1e-7 relative: 2^n e^r with n = round(x log2 e), |r| <= ln 2 / 2,
// e^r a degree-6 Taylor polynomial; under e^-87 it is 0. A scalar exp per key would cost more than the key's dot.
inline V exp_nonpositive(V x) {
  x = maxf(x, set1(-87.f));
  const V n = roundf_(mulf(x, set1(1.44269504088896341f)));
  const V r = fmadd(n, set1(-0.693359375f), fmadd(n, set1(2.12194440e-4f), x));  // x - n ln 2, ln 2 in two parts
  V p = set1(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = fmadd(p, r, set1(c));
  return mulf(p, pow2(n));
}

constexpr int kMaxVectors = 16;  // the widest head eyas::attend takes: 16 vectors (256 dims on AVX-512, 128 on AVX2)

// Scores p[0:S] plus a mask row -> e^(p - top) in place, top their max; returns their sum, 0 for a row that sees no
// key (top -inf).
inline float softmax_row(float* p, const float* mask, int64_t mask_stride, int64_t S, float& top) {
  constexpr int64_t n = kLanes / 2;
  top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < S; ++j) top = std::max(top, p[j] += mask ? mask[j * mask_stride] : 0.f);
  if (top == -std::numeric_limits<float>::infinity()) return 0.f;
  const V tv = set1(top);
  V sum = zero();
  int64_t j = 0;
  for (; j + n <= S; j += n) {
    const V e = exp_nonpositive(subf(loadf(p + j), tv));
    storef(p + j, e);
    sum = addf(sum, e);
  }
  float total = reduce(sum);
  for (; j < S; ++j) total += (p[j] = std::exp(p[j] - top));
  return total;
}

// One query row of R query heads that read the same key/value head (GQA) over S of its keys and values, each a row
// of NV vectors of fp32 lanes (D = NV * lanes): every key and value row is widened once for the R heads, four keys'
// partial dots of a head are reduced together, and each value row is prefetched as its key is read (the cache is
// cold: a step's weight reads have evicted it). p [R, S] is scratch; part [R, D + 2] the result, per head the
// unnormalised sum of values weighted by e^(score - top), then top and the weights' sum (merge_parts).
template <typename T, int NV, int R>
void attend_heads(const T* const* q, const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                  const float* const* mask, int64_t mask_stride, int64_t S, float scale, float* p, float* part) {
  constexpr int64_t n = kLanes / 2, D = NV * n, kRowBytes = D * int64_t(sizeof(T));
  V qv[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) qv[r][i] = mulf(widen(q[r] + i * n), set1(scale));
  int64_t j = 0;
  for (; j + 4 <= S; j += 4) {  // four keys at a time: 4 R independent chains
    V acc[R][4];
    for (int u = 0; u < 4; ++u) {
      const T* kr = k + (j + u) * k_stride;
      const char* vr = reinterpret_cast<const char*>(v + (j + u) * v_stride);
      for (int64_t b = 0; b < kRowBytes; b += 64) _mm_prefetch(vr + b, _MM_HINT_T0);
      for (int i = 0; i < NV; ++i) {
        const V kv = widen(kr + i * n);
        for (int r = 0; r < R; ++r) acc[r][u] = i ? fmadd(qv[r][i], kv, acc[r][u]) : mulf(qv[r][0], kv);
      }
    }
    for (int r = 0; r < R; ++r) reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], p + r * S + j);
  }
  for (; j < S; ++j)
    for (int r = 0; r < R; ++r) {
      V acc = mulf(qv[r][0], widen(k + j * k_stride));
      for (int i = 1; i < NV; ++i) acc = fmadd(qv[r][i], widen(k + j * k_stride + i * n), acc);
      p[r * S + j] = reduce(acc);
    }
  float total[R], top[R];
  for (int r = 0; r < R; ++r) total[r] = softmax_row(p + r * S, mask[r], mask_stride, S, top[r]);
  V o[R][NV];  // R * NV independent chains (attend_block keeps R * NV <= 16, or R = 1)
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) o[r][i] = zero();
  for (j = 0; j < S; ++j)
    for (int i = 0; i < NV; ++i) {
      const V vv = widen(v + j * v_stride + i * n);
      for (int r = 0; r < R; ++r) o[r][i] = fmadd(set1(p[r * S + j]), vv, o[r][i]);
    }
  for (int r = 0; r < R; ++r) {  // a row that sees no key: zeros (not 0 times whatever the values hold)
    float* out = part + r * (D + 2);
    for (int i = 0; i < NV; ++i) storef(out + i * n, total[r] > 0.f ? o[r][i] : zero());
    out[D] = top[r];
    out[D + 1] = total[r];
  }
}

// The attention of one head from its key chunks' parts (attend_heads; `stride` floats apart): the chunks' weighted
// sums rescaled to the largest top and divided by the weights' total (flash-decoding's merge); zeros where no chunk
// saw a key.
template <typename Out>
void merge_parts(const float* part, int64_t chunks, int64_t stride, int64_t D, Out* out) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < chunks; ++c) top = std::max(top, part[c * stride + D]);
  if (top == -std::numeric_limits<float>::infinity()) {
    std::fill(out, out + D, Out(0.f));
    return;
  }
  float o[kMaxVectors * (kLanes / 2)] = {}, total = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* pc = part + c * stride;
    const float w = std::exp(pc[D] - top);  // 0 for a chunk that saw no key (its sums are 0 too)
    total += pc[D + 1] * w;
    for (int64_t d = 0; d < D; ++d) o[d] += pc[d] * w;
  }
  for (int64_t d = 0; d < D; ++d) out[d] = Out(o[d] / total);
}

// How many query heads of a GQA group one attend_heads call takes: their outputs' NV vectors each stay in registers.
constexpr int kBlockHeads = 4;
constexpr int heads_per_block(int nv) { return std::max(1, std::min(kBlockHeads, 16 / nv)); }
constexpr int64_t kMinKeys = 32;  // the fewest keys a chunk of a row's keys takes (attend_all)

template <typename T, int NV, int R = 1>
void attend_block(int r, const T* const* q, const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                  const float* const* mask, int64_t mask_stride, int64_t S, float scale, float* p, float* part) {
  if constexpr (R <= heads_per_block(NV)) {
    if (r == R) return attend_heads<T, NV, R>(q, k, k_stride, v, v_stride, mask, mask_stride, S, scale, p, part);
    attend_block<T, NV, R + 1>(r, q, k, k_stride, v, v_stride, mask, mask_stride, S, scale, p, part);
  }
}

template <typename T, typename Out, int NV>
void attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, double scale,
                at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), D = q.size(3), G = k.size(1), S = k.size(2);
  const int64_t group = H / G, per = heads_per_block(NV), blocks = (group + per - 1) / per;
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  const float* mp = mask.defined() ? mask.data_ptr<float>() : nullptr;
  Out* op = out.data_ptr<Out>();
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides(), os = out.strides();
  const auto ms = mask.defined() ? mask.strides() : at::IntArrayRef();
  // rows: (batch, key/value head, query row, block of that head's query heads). Where they do not divide evenly among
  // the threads (a step's 3 key/value heads on 2 threads), each row's keys are split into chunks that do (at least
  // kMinKeys each), merged after: every thread gets as much work.
  const int64_t rows = B * G * T_ * blocks, threads = at::get_num_threads();
  const int64_t chunks = std::max<int64_t>(1, std::min(threads / std::gcd(rows, threads), S / kMinKeys));
  const int64_t span = (S + chunks - 1) / chunks, stride = D + 2;  // keys per chunk; floats per head's part
  c10::SmallVector<float, 2048> parts(rows * chunks * per * stride);  // on the stack for a decoding step's few rows
  struct Row { int64_t b, g, t, h0, heads; };  // a row's batch, key/value head, query row, first query head, count
  const auto row_at = [&](int64_t row) {
    const int64_t g = row / (T_ * blocks) % G, h0 = g * group + row % blocks * per;
    return Row{row / (G * T_ * blocks), g, row / blocks % T_, h0, std::min(per, g * group + group - h0)};
  };
  // a run of units of at least ~64k multiply-adds: a parallel region costs a few us
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, span * D * per));
  at::parallel_for(0, rows * chunks, grain, [&](int64_t begin, int64_t end) {
    c10::SmallVector<float, 1024> p(per * span);
    const T* qr[kBlockHeads];
    const float* mr[kBlockHeads];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i % chunks, j0 = c * span, n = std::max<int64_t>(0, std::min(span, S - j0));
      const auto [b, g, t, h0, r] = row_at(i / chunks);
      for (int64_t u = 0; u < r; ++u) {
        qr[u] = qp + b * qs[0] + (h0 + u) * qs[1] + t * qs[2];
        mr[u] = mp ? mp + b * ms[0] + (h0 + u) * ms[1] + t * ms[2] + j0 * ms[3] : nullptr;
      }
      attend_block<T, NV>(int(r), qr, kp + b * ks[0] + g * ks[1] + j0 * ks[2], ks[2],
                          vp + b * vs[0] + g * vs[1] + j0 * vs[2], vs[2], mr, mp ? ms[3] : 0, n, float(scale),
                          p.data(), parts.data() + i * per * stride);
    }
  });
  for (int64_t row = 0; row < rows; ++row) {
    const auto [b, g, t, h0, r] = row_at(row);
    for (int64_t u = 0; u < r; ++u)
      merge_parts(parts.data() + (row * chunks * per + u) * stride, chunks, per * stride, D,
                  op + b * os[0] + (h0 + u) * os[1] + t * os[2]);
  }
}

template <typename T, typename Out, int NV = 1>
void attend_dispatch(int nv, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                     double scale, at::Tensor& out) {
  if constexpr (NV <= kMaxVectors) {
    if (nv == NV) return attend_all<T, Out, NV>(q, k, v, mask, scale, out);
    attend_dispatch<T, Out, NV + 1>(nv, q, k, v, mask, scale, out);
  }
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                  double scale, int64_t most_rows) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(q.device().is_cpu() && (dtype == at::kBFloat16 || dtype == at::kFloat) && k.scalar_type() == dtype &&
                  v.scalar_type() == dtype && k.device().is_cpu() && v.device().is_cpu(),
              "eyas::attend: q, k, v must be bf16 or fp32 on CPU, of one dtype");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && k.size(0) == q.size(0) &&
                  k.size(3) == q.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "eyas::attend: q [B, H, T, D] and k, v [B, G, S, D] with H a multiple of G, got ", q.sizes(), " and ",
              k.sizes());
  TORCH_CHECK(q.size(3) % (kLanes / 2) == 0 && q.size(3) / (kLanes / 2) <= kMaxVectors,
              "eyas::attend: head size ", q.size(3), " is not a multiple of ", kLanes / 2, " up to ",
              kMaxVectors * kLanes / 2, " (`attend_takes`)");
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), D = q.size(3), S = k.size(2);
  at::Tensor out = at::empty_strided({B, H, T_, D}, {T_ * H * D, D, H * D, 1}, q.options());  // [B, T, H, D] laid out
  const bool masked = mask.has_value() && mask->defined();
  // the mask as scores to add, in `dtype` (a bool mask: 0 where seen, -inf elsewhere)
  auto additive = [&](at::ScalarType dtype) {
    const auto options = mask->options().dtype(dtype);
    const float unseen = -std::numeric_limits<float>::infinity();
    return mask->scalar_type() == at::kBool ? at::where(*mask, at::zeros({}, options), at::full({}, unseen, options))
                                            : mask->to(dtype);
  };
  if (most_rows >= 0 && T_ > most_rows) {  // more query rows than this kernel is the faster attention of: torch's,
    // which takes a mask in q's dtype, as SDPA hands it one
    const auto flash = at::_scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, false, masked ? c10::optional<at::Tensor>(additive(dtype)) : c10::nullopt, scale);
    return out.copy_(std::get<0>(flash));
  }
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
  const at::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  at::Tensor m;
  if (masked) m = additive(at::kFloat).expand({B, H, T_, S});
  const int nv = int(D / (kLanes / 2));
  if (dtype == at::kFloat)
    attend_dispatch<float, float>(nv, qc, kc, vc, m, scale, out);
  else
    attend_dispatch<uint16_t, at::BFloat16>(nv, qc, kc, vc, m, scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(eyas, m) {
  m.def("row_gemv(Tensor x, Tensor[] weights) -> Tensor");
  m.def("row_gemv_at(Tensor x, Tensor arena, int[] offsets, int[] rows) -> Tensor");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, int most_rows=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(eyas, CPU, m) {
  m.impl("row_gemv", &row_gemv);
  m.impl("row_gemv_at", &row_gemv_at);
  m.impl("attend", &attend);
}

// The kernels as C functions, for inductor's C++ wrapper: it calls an op listed in its aot_inductor.custom_ops_to_c_shims
// as aoti_torch_<device>_<op> (declared by row_gemv.py's C_SHIMS), not through the dispatcher's boxed call, which
// costs ~1 us more each of a step's ~150 calls. Each records the op's name for profilers, as a dispatched call does.
namespace {
const at::Tensor& tensor(AtenTensorHandle handle) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(handle);
}
}  // namespace

extern "C" {

AOTITorchError aoti_torch_cpu_row_gemv(AtenTensorHandle x, const AtenTensorHandle* weights, int64_t count,
                                       AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("eyas::row_gemv", c10::ArrayRef<const c10::IValue>{});
    c10::SmallVector<at::Tensor, 4> ws;
    for (int64_t i = 0; i < count; ++i) ws.push_back(tensor(weights[i]));
    *out = torch::aot_inductor::new_tensor_handle(row_gemv(tensor(x), ws));
  });
}

AOTITorchError aoti_torch_cpu_row_gemv_at(AtenTensorHandle x, AtenTensorHandle arena, const int64_t* offsets,
                                          int64_t offsets_len, const int64_t* rows, int64_t rows_len,
                                          AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("eyas::row_gemv_at", c10::ArrayRef<const c10::IValue>{});
    *out = torch::aot_inductor::new_tensor_handle(
        row_gemv_at(tensor(x), tensor(arena), {offsets, size_t(offsets_len)}, {rows, size_t(rows_len)}));
  });
}

AOTITorchError aoti_torch_cpu_attend(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle* mask,
                                     double scale, int64_t most_rows, AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("eyas::attend", c10::ArrayRef<const c10::IValue>{});
    const c10::optional<at::Tensor> m = mask ? c10::optional<at::Tensor>(tensor(*mask)) : c10::nullopt;
    *out = torch::aot_inductor::new_tensor_handle(attend(tensor(q), tensor(k), tensor(v), m, scale, most_rows));
  });
}

}  // extern "C"
