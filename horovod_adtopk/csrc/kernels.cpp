// Native CPU selection kernels for horovod_adtopk (the extension module horovod_adtopk._C).
//
// Every selection ranks entries by the key |x| with NaN mapped to +inf (so NaN and +-Inf rank above every
// finite magnitude). Keys are compared as float (fp16 / bf16 / fp32 inputs, all exactly representable) or
// double (fp64 inputs).
//
// Exact top-k of a fiber without sorting it
// -----------------------------------------
// The fiber is partitioned into groups of BLOCK entries and the maximum key of every group is recorded
// during the first pass over the data (fused with the error-feedback add ``a += grad``). Row fibers and
// the flat tensor use interleaved groups (entries j, j + G, j + 2G, ...: the maxima are elementwise
// maxima of contiguous runs, so the pass vectorises); column fibers use blocks of BLOCK consecutive rows.
// If at least k group maxima are >= t, those groups hold k distinct entries >= t, so the k-th largest key
// of the fiber is >= t: every entry of the top-k has key >= t and lies in a group whose maximum is >= t.
// t is the order statistic of a small strided sample of the maxima that should leave a few more than k
// groups, checked by counting (and the exact k-th largest maximum when the check fails), so exactness
// never depends on the sample. Only the groups reaching t are scanned again (a few more than k of them),
// their entries with key >= t are compacted as candidates, and an exact selection (nth_element) among the
// candidates finishes the job. Ties at the k-th key are resolved towards the lower index, and positions
// come out in ascending order.
//
// When k is a large share of the fiber (too few groups per kept entry), the threshold comes from a strided
// sample of the fiber's own keys instead, checked by counting (sample_plan); where even that would keep half
// the fiber, all entries are candidates.
//
// Column fibers are read in row-major passes over slabs of adjacent columns (adtopk_cols_slabs): walking a
// column tile row by row costs a TLB miss per row once rows are a few KB long. The tiled walk (adtopk_cols)
// remains for the short or dense fibers that take every entry.
//
// SIMD
// ----
// The first passes (interleaved group maxima of row fibers and the flat tensor; block maxima of column
// tiles and slabs) and the slabs' candidate pass have explicit AVX2 versions for float32, float16 (F16C conversions) and bfloat16, compiled with
// per-function target attributes (the rest of the file, and the build, stay generic x86-64) and chosen at
// run time when the CPU has AVX2 and F16C, unless HOROVOD_ADTOPK_SIMD=0 (read on every call). They compute
// exactly what the scalar loops compute (the same rounded sum in the tensor's dtype, the same keys; max of
// non-NaN keys is exact), so results never depend on the path taken, nor on the number of threads (every
// fiber is selected by one thread, with the same algorithm).

#include <torch/extension.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAT_X86_SIMD 1
#define HAT_AVX2 __attribute__((target("avx2,f16c")))
#else
#define HAT_X86_SIMD 0
#endif

namespace {

constexpr int64_t BLOCK = 16;  // entries per block (one 64-byte cache line of fp32)

template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

template <typename A> inline A inf_of() { return std::numeric_limits<A>::infinity(); }

// |x|, with NaN -> +inf. Written branch-free so that loops using it vectorise.
template <typename A, typename T> inline A key_of(T x) {
  A v = std::abs(static_cast<A>(x));
  return v == v ? v : inf_of<A>();
}

// The smallest A >= t (exact comparison of A keys against a double threshold); NaN gives +inf.
template <typename A> A ceil_to(double t) {
  if (std::isnan(t)) return inf_of<A>();  // only non-finite entries (key +inf) pass
  if (t > static_cast<double>(std::numeric_limits<A>::max())) return inf_of<A>();
  if (t < -static_cast<double>(std::numeric_limits<A>::max())) return -inf_of<A>();
  A f = static_cast<A>(t);
  if (static_cast<double>(f) < t) f = std::nextafter(f, inf_of<A>());
  return f;
}

// Whether a key passes threshold t (from ceil_to, never NaN): non-finite keys are +inf and always pass.
template <typename A> inline bool passes(A key, A t) { return key >= t; }

template <typename U> std::unique_ptr<U[]> buffer(int64_t n) { return std::unique_ptr<U[]>(new U[std::max<int64_t>(n, 1)]); }

inline int64_t num_blocks(int64_t n) { return (n + BLOCK - 1) / BLOCK; }

// Whether a fiber of length n keeping k goes straight to an exact selection over all entries.
inline bool direct_select(int64_t n, int64_t k) { return n < 4 * BLOCK || k * 4 * BLOCK > n; }

template <typename T, typename A> inline T add_as(T x, T g) { return static_cast<T>(static_cast<A>(x) + static_cast<A>(g)); }

// Per-thread scratch for fiber selection.
template <typename A> struct Scratch {
  int64_t cap = 0;
  std::unique_ptr<A[]> tmp, ckey;
  std::unique_ptr<int64_t[]> cidx;
  std::unique_ptr<int64_t[]> hits;
  void reserve(int64_t n) {
    if (n + BLOCK <= cap) return;
    cap = n + BLOCK;
    tmp = buffer<A>(cap);
    ckey = buffer<A>(cap);
    cidx = buffer<int64_t>(cap);
    hits = buffer<int64_t>(cap / BLOCK + 1);
  }
};

// The k-th largest of v[0..c) (v is copied into tmp).
template <typename A> A kth_largest(const A* v, int64_t c, int64_t k, A* tmp) {
  std::copy(v, v + c, tmp);
  std::nth_element(tmp, tmp + (k - 1), tmp + c, std::greater<A>());
  return tmp[k - 1];
}

// A threshold t such that at least k of v[0..m) are >= t, close to the k-th largest: the order statistic
// of a strided sample that should leave a few more than k, checked by counting; the exact k-th largest
// (nth_element) when the check fails. Any such t bounds the fiber's k-th largest key from below.
template <typename A> A group_threshold(const A* v, int64_t m, int64_t k, A* tmp) {
  constexpr int64_t S = 256;
  if (m >= 4 * S) {
    for (int64_t i = 0; i < S; ++i) tmp[i] = v[(i * m) / S];
    const double e = static_cast<double>(k) * S / m;
    const int64_t j = static_cast<int64_t>(std::ceil(e + 3.0 * std::sqrt(e) + 2.0));
    if (j <= S) {
      std::nth_element(tmp, tmp + (j - 1), tmp + S, std::greater<A>());
      const A t = tmp[j - 1];
      int32_t cnt = 0;
      for (int64_t i = 0; i < m; ++i) cnt += v[i] >= t;
      if (cnt >= k) return t;
    }
  }
  return kth_largest(v, m, k, tmp);
}

// Final step: among candidates (ckey, cidx) in ascending index order, at least k of them, write the top-k
// positions in ascending order to out; ties at the k-th key go to the lower index.
// Few candidates: rank every one by counting (the keys above it, and equal keys at lower indices), with no
// data-dependent branch; nth_element's comparisons mispredict about half the time at these sizes.
constexpr int64_t RANK_MAX = 64;
// With AVX2 (float keys): counting ranks below RADIX_MIN candidates, the bitwise search up to RADIX_MAX.
constexpr int64_t RADIX_MIN = 24, RADIX_MAX = 4096;

// out holds k positions: the loop ends with the k-th (every write is at o < k).
template <typename A> void finish_by_rank(const A* ckey, const int64_t* cidx, int64_t c, int64_t k, int64_t* out) {
  int64_t o = 0;
  for (int64_t i = 0; i < c && o < k; ++i) {
    const A v = ckey[i];
    int32_t above = 0;
    for (int64_t j = 0; j < i; ++j) above += ckey[j] >= v;
    for (int64_t j = i + 1; j < c; ++j) above += ckey[j] > v;
    out[o] = cidx[i];
    o += above < k;
  }
}

#if HAT_X86_SIMD
// The sum of 8 int32 lanes.
HAT_AVX2 inline int32_t hsum8(__m256i a) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return _mm_cvtsi128_si32(s4);
}

// finish_by_rank for fewer than RADIX_MIN candidates (float keys), 8 candidates ranked at once: every
// candidate j is broadcast and compared with a vector of 8 candidates i (>= where j < i, > where j > i), so
// the ranks come out in lanes with no horizontal sum; the keys are copied into a buffer padded with -1, a
// key below every real one, so the lanes beyond c rank last and are masked off.
HAT_AVX2 void finish_by_rank_avx2(const float* ckey, const int64_t* cidx, int64_t c, int64_t k, int64_t* out) {
  alignas(32) float kk[RADIX_MIN + 8];
  const int64_t cp = (c + 7) & ~int64_t(7);
  std::copy(ckey, ckey + c, kk);
  std::fill(kk + c, kk + cp, -1.0f);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), kv = _mm256_set1_epi32(static_cast<int>(k));
  int64_t o = 0;
  for (int64_t i0 = 0; i0 < cp; i0 += 8) {
    const __m256 vi = _mm256_load_ps(kk + i0);
    const __m256i ii = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(i0)), lane);
    __m256i above = _mm256_setzero_si256();
    for (int64_t j = 0; j < c; ++j) {
      const __m256 vj = _mm256_set1_ps(kk[j]);
      const __m256 before = _mm256_castsi256_ps(_mm256_cmpgt_epi32(ii, _mm256_set1_epi32(static_cast<int>(j))));
      const __m256 ge = _mm256_cmp_ps(vj, vi, _CMP_GE_OQ), gt = _mm256_cmp_ps(vj, vi, _CMP_GT_OQ);
      above = _mm256_sub_epi32(above, _mm256_castps_si256(_mm256_blendv_ps(gt, ge, before)));
    }
    unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(kv, above))));
    if (i0 + 8 > c) m &= (1u << (c - i0)) - 1u;
    for (; m != 0; m &= m - 1) out[o++] = cidx[i0 + __builtin_ctz(m)];
  }
}

// More candidates (float keys, AVX2): the k-th largest key T is found bit by bit from its top, as the largest
// bit pattern u with at least k keys >= u (keys are |x| with NaN -> +inf, never -0, so their bit patterns as
// integers order as the floats do and are equal only where the floats are). Each of the at most 31 rounds
// counts the candidates at or above one pattern, 8 at a time, with no data-dependent branch; the bits above
// the highest one where the smallest and largest candidate differ are known from the start, and the search
// stops where exactly k keys reach the pattern (they are the top k; usually a dozen rounds). Then every key
// above T is taken and the keys equal to T in ascending index order until k are: what finish_by_rank gives.
// Cost: about rounds * c / 8 compares against c * c / 8 for the ranking, which wins below RADIX_MIN
// candidates; above RADIX_MAX (measured up to a few thousand) nth_element is kept.
static_assert(RADIX_MIN >= 8 && RADIX_MIN <= RANK_MAX, "the radix search reads a full vector; counting covers below it");

HAT_AVX2 void finish_by_radix_avx2(const float* ckey, const int64_t* cidx, int64_t c, int64_t k, int64_t* out) {
  const int32_t* u = reinterpret_cast<const int32_t*>(ckey);  // keys >= 0: sign bit clear, int order = float order
  const int64_t c8 = c - c % 8;
  __m256i lo = _mm256_set1_epi32(INT32_MAX), hi = _mm256_setzero_si256();
  for (int64_t j = 0; j < c8; j += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + j));
    lo = _mm256_min_epi32(lo, v);
    hi = _mm256_max_epi32(hi, v);
  }
  int32_t lo_s[8], hi_s[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo_s), lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi_s), hi);
  uint32_t mn = UINT32_MAX, mx = 0;
  for (int q = 0; q < 8; ++q) {  // c8 >= 8: every lane saw a key
    mn = std::min(mn, static_cast<uint32_t>(lo_s[q]));
    mx = std::max(mx, static_cast<uint32_t>(hi_s[q]));
  }
  for (int64_t j = c8; j < c; ++j) {
    mn = std::min(mn, static_cast<uint32_t>(u[j]));
    mx = std::max(mx, static_cast<uint32_t>(u[j]));
  }
  // count(u >= prefix) >= k holds throughout: prefix starts at or below the smallest key
  uint32_t prefix = mx;
  if (mn != mx) {
    const int hb = 31 - __builtin_clz(mn ^ mx);
    prefix = mx & ~((2u << hb) - 1u);  // hb <= 30: keys are below 2^31
    for (int b = hb; b >= 0; --b) {
      const uint32_t cand = prefix | (1u << b);
      const __m256i cm1 = _mm256_set1_epi32(static_cast<int32_t>(cand - 1u));
      __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
      int64_t j = 0;
      for (; j + 16 <= c8; j += 16) {
        acc0 = _mm256_sub_epi32(acc0, _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + j)), cm1));
        acc1 = _mm256_sub_epi32(acc1, _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + j + 8)), cm1));
      }
      if (j < c8)
        acc0 = _mm256_sub_epi32(acc0, _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + j)), cm1));
      int64_t cnt = hsum8(_mm256_add_epi32(acc0, acc1));
      for (int64_t t = c8; t < c; ++t) cnt += static_cast<uint32_t>(u[t]) >= cand;
      prefix = cnt >= k ? cand : prefix;
      if (cnt == k) break;  // exactly k keys reach prefix: they are the top k, whatever the lower bits of T
    }
  }
  const int32_t T = static_cast<int32_t>(prefix);
  int64_t gt = 0;
  for (int64_t j = 0; j < c; ++j) gt += u[j] > T;
  int64_t quota = k - gt;  // >= 1: at least k keys are >= T
  int64_t o = 0;
  for (int64_t i = 0; i < c && o < k; ++i) {
    const bool eq = u[i] == T;
    const bool take = u[i] > T || (eq && quota > 0);
    quota -= eq && take;
    out[o] = cidx[i];
    o += take;
  }
}
#endif

template <typename A>
void finish(const A* ckey, const int64_t* cidx, int64_t c, int64_t k, A* tmp, int64_t* out, bool simd = false) {
  if (c == k) {
    std::copy(cidx, cidx + c, out);
    return;
  }
#if HAT_X86_SIMD
  if constexpr (std::is_same<A, float>::value) {
    if (simd && c < RADIX_MIN) return finish_by_rank_avx2(ckey, cidx, c, k, out);
    if (simd && c <= RADIX_MAX) return finish_by_radix_avx2(ckey, cidx, c, k, out);
  }
#endif
  if (c <= RANK_MAX) return finish_by_rank(ckey, cidx, c, k, out);
  const A kth = kth_largest(ckey, c, k, tmp);
  int64_t gt = 0;
  for (int64_t j = 0; j < c; ++j) gt += ckey[j] > kth;
  int64_t quota = k - gt;
  int64_t o = 0;
  for (int64_t j = 0; j < c; ++j) {
    const A v = ckey[j];
    if (v > kth) {
      out[o++] = cidx[j];
    } else if (v == kth && quota > 0) {
      out[o++] = cidx[j];
      --quota;
    }
  }
}


// Where block maxima cannot bound the k-th key (direct_select: k is more than one entry in 4 * BLOCK), a
// strided sample of the fiber's own keys still can: the j-th largest of S sampled keys, j a few standard
// deviations above the k * S / n expected to reach the k-th largest, should leave a few more than k entries
// at or above it. The pass that compacts them counts them, and a fiber left with fewer than k takes every
// entry instead, so exactness never depends on the sample. Worth it when it leaves well under the fiber.
struct SamplePlan {
  int64_t S = 0, j = 0;  // sample size and the order statistic to take; S == 0: no sampling (every entry)
};

inline SamplePlan sample_plan(int64_t n, int64_t k) {
  SamplePlan p;
  const int64_t S = std::min<int64_t>(256, n / 4);
  if (S < 64) return p;
  const double e = static_cast<double>(k) * S / n;
  const int64_t j = static_cast<int64_t>(std::ceil(e + 3.0 * std::sqrt(e) + 2.0));
  if (2 * j > S) return p;  // it would keep half the fiber or more: select among all entries
  p.S = S;
  p.j = j;
  return p;
}

// The plan's threshold from the S sampled keys in v (reordered).
template <typename A> A sample_threshold(A* v, const SamplePlan& p) {
  std::nth_element(v, v + (p.j - 1), v + p.S, std::greater<A>());
  return v[p.j - 1];
}

// ---- AVX2 -------------------------------------------------------------------------------------------------

// Whether the CPU can run the AVX2 paths (checked once).
bool cpu_has_avx2() {
#if HAT_X86_SIMD
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

// Whether this call takes the AVX2 paths: the CPU has them and HOROVOD_ADTOPK_SIMD is not "0".
bool use_simd() {
  if (!cpu_has_avx2()) return false;
  const char* e = std::getenv("HOROVOD_ADTOPK_SIMD");
  return e == nullptr || std::strcmp(e, "0") != 0;
}

std::string simd_path() { return use_simd() ? "avx2" : "scalar"; }

// Whether the selection takes the row-major slab passes for column fibers (adtopk_cols_slabs) and sampled
// thresholds where block maxima cannot bound the k-th key (sample_plan): unless HOROVOD_ADTOPK_LEGACY_SELECT
// is "1" (read on every call), which keeps the earlier paths (the tiled column walk of adtopk_cols, every
// entry a candidate). Both give the same result, bit for bit.
bool use_slabs() {
  const char* e = std::getenv("HOROVOD_ADTOPK_LEGACY_SELECT");
  return e == nullptr || std::strcmp(e, "1") != 0;
}

#if HAT_X86_SIMD
// 8 lanes of T as float: load, and store of a float rounded to T exactly as static_cast<T>(float) does.
template <typename T> struct Lanes;

template <> struct Lanes<float> {
  static HAT_AVX2 inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  // Stores v; returns the stored value as float.
  static HAT_AVX2 inline __m256 store(float* p, __m256 v) {
    _mm256_storeu_ps(p, v);
    return v;
  }
};

template <> struct Lanes<c10::Half> {
  static HAT_AVX2 inline __m256 load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static HAT_AVX2 inline __m256 store(c10::Half* p, __m256 v) {
    __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // c10::Half writes every NaN as sign | 0x7E00; F16C keeps payload bits: make them the same.
    const __m256i nan32 = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m128i nan = _mm_packs_epi32(_mm256_castsi256_si128(nan32), _mm256_extracti128_si256(nan32, 1));
    const __m128i canon = _mm_or_si128(_mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0x8000))),
                                       _mm_set1_epi16(0x7E00));
    h = _mm_blendv_epi8(h, canon, nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    return _mm256_cvtph_ps(h);
  }
};

template <> struct Lanes<c10::BFloat16> {
  static HAT_AVX2 inline __m256 widen(__m128i b) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  }
  static HAT_AVX2 inline __m256 load(const c10::BFloat16* p) {
    return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // Round to nearest even as c10::BFloat16(float) does, NaN -> 0x7FC0.
  static HAT_AVX2 inline __m256 store(c10::BFloat16* p, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(u, 16),
                                                                                      _mm256_set1_epi32(1)));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m128i b = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
    return widen(b);
  }
};

// |v| with NaN -> +inf (key_of on 8 lanes).
HAT_AVX2 inline __m256 keys8(__m256 v) {
  const __m256 mag = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
  return _mm256_blendv_ps(mag, _mm256_set1_ps(std::numeric_limits<float>::infinity()), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// 8 keys of x[0..8), after x += g when g is given (the sum rounded to T, as add_as).
template <typename T> HAT_AVX2 inline __m256 step8(T* x, const T* g) {
  if (g == nullptr) return keys8(Lanes<T>::load(x));
  return keys8(Lanes<T>::store(x, _mm256_add_ps(Lanes<T>::load(x), Lanes<T>::load(g))));
}
#endif

template <typename T> struct HasLanes { static constexpr bool value = false; };
template <> struct HasLanes<float> { static constexpr bool value = true; };
template <> struct HasLanes<c10::Half> { static constexpr bool value = true; };
template <> struct HasLanes<c10::BFloat16> { static constexpr bool value = true; };

// ---- segments with interleaved groups ------------------------------------------------------------------
//
// A contiguous segment of length L has G = L / BLOCK groups; group j holds entries j, j + G, ...,
// j + (BLOCK - 1) G. The last L - BLOCK * G entries (the tail, fewer than BLOCK) belong to no group and are
// always scanned. Group maxima are elementwise maxima of BLOCK contiguous runs, so the first pass is a
// plain vectorisable loop, and rescanning the hit groups row by row visits entries in ascending order.

// First pass: x += g (optional), group maxima of the keys into gm[0..G).
template <typename T, typename A>
void pass_segment_scalar(T* __restrict x, const T* __restrict g, int64_t L, A* __restrict gm) {
  const int64_t G = L / BLOCK;
  if (g != nullptr)
    for (int64_t i = BLOCK * G; i < L; ++i) x[i] = add_as<T, A>(x[i], g[i]);
  if (G == 0) return;
  for (int64_t j = 0; j < G; ++j) {
    if (g != nullptr) x[j] = add_as<T, A>(x[j], g[j]);
    gm[j] = key_of<A>(x[j]);
  }
  for (int64_t r = 1; r < BLOCK; ++r) {
    T* __restrict xr = x + r * G;
    if (g != nullptr) {
      const T* __restrict gr = g + r * G;
      for (int64_t j = 0; j < G; ++j) {
        const T v = add_as<T, A>(xr[j], gr[j]);
        xr[j] = v;
        const A kv = key_of<A>(v);
        gm[j] = gm[j] > kv ? gm[j] : kv;
      }
    } else {
      for (int64_t j = 0; j < G; ++j) {
        const A kv = key_of<A>(xr[j]);
        gm[j] = gm[j] > kv ? gm[j] : kv;
      }
    }
  }
}

#if HAT_X86_SIMD
// pass_segment_scalar on 8 groups at a time (float keys only).
template <typename T>
HAT_AVX2 void pass_segment_avx2(T* __restrict x, const T* __restrict g, int64_t L, float* __restrict gm) {
  const int64_t G = L / BLOCK;
  if (g != nullptr)
    for (int64_t i = BLOCK * G; i < L; ++i) x[i] = add_as<T, float>(x[i], g[i]);
  if (G == 0) return;
  const int64_t G8 = G - G % 8;
  for (int64_t r = 0; r < BLOCK; ++r) {
    T* __restrict xr = x + r * G;
    const T* __restrict gr = g != nullptr ? g + r * G : nullptr;
    for (int64_t j = 0; j < G8; j += 8) {
      const __m256 kv = step8<T>(xr + j, gr != nullptr ? gr + j : nullptr);
      _mm256_storeu_ps(gm + j, r == 0 ? kv : _mm256_max_ps(_mm256_loadu_ps(gm + j), kv));
    }
    for (int64_t j = G8; j < G; ++j) {
      if (gr != nullptr) xr[j] = add_as<T, float>(xr[j], gr[j]);
      const float kv = key_of<float>(xr[j]);
      gm[j] = r == 0 ? kv : (gm[j] > kv ? gm[j] : kv);
    }
  }
}
#endif

template <typename T, typename A>
void pass_segment(T* x, const T* g, int64_t L, A* gm, bool simd) {
#if HAT_X86_SIMD
  if constexpr (HasLanes<T>::value) {
    if (simd) return pass_segment_avx2<T>(x, g, L, gm);
  }
#endif
  pass_segment_scalar<T, A>(x, g, L, gm);
}

// Groups of a segment whose maximum reaches t, ascending, into hits; returns how many.
template <typename A> int64_t hit_groups(const A* gm, int64_t G, A t, int64_t* hits) {
  int64_t h = 0;
  for (int64_t j = 0; j < G; ++j) {
    hits[h] = j;
    h += gm[j] >= t;
  }
  return h;
}

// Appends the entries with key >= t of the hit groups and the tail, in ascending index order (base + i),
// starting at ckey/cidx[c]; returns the new count. Needs room for h * BLOCK + BLOCK more entries.
template <typename A, typename T>
int64_t scan_segment(const T* x, int64_t L, const int64_t* hits, int64_t h, A t, int64_t base, A* ckey,
                     int64_t* cidx, int64_t c) {
  const int64_t G = L / BLOCK;
  for (int64_t r = 0; r < BLOCK && G > 0; ++r) {
    const T* xr = x + r * G;
    for (int64_t q = 0; q < h; ++q) {  // branch-free compaction
      const int64_t j = hits[q];
      const A v = key_of<A>(xr[j]);
      ckey[c] = v;
      cidx[c] = base + r * G + j;
      c += v >= t;
    }
  }
  for (int64_t i = BLOCK * G; i < L; ++i) {
    const A v = key_of<A>(x[i]);
    ckey[c] = v;
    cidx[c] = base + i;
    c += v >= t;
  }
  return c;
}

// ---- hints ----------------------------------------------------------------------------------------------
//
// A selection that runs every step on the same error-feedback memory sees its fibers' k-th largest keys move
// slowly. With a hint per fiber (a threshold below the last call's k-th key), a row fiber takes one fused
// pass that does x += g and compacts the entries whose key reaches the hint (a slab of column fibers: its
// candidate pass against the hints, with the add fused into it on the AVX2 path); if at least k did, the fiber's k-th largest key is >=
// the hint, so every entry of its top-k (ties included) is a candidate and finish() gives exactly what the
// other paths give. A fiber with fewer than k candidates is selected by the usual path (a row, its add
// already done) or among all of its entries (a column), so exactness never depends on the hint; the hint
// only saves the block maxima or the sample, the threshold and, for rows, the rescan. After the selection
// the hint becomes hint_decay(k) times the fiber's k-th key (0: no hint): the k-th key of the next step's
// memory spreads about as 1 / sqrt(k), so the margin does too. On random steady-state error feedback with
// k = 1% of the fiber this leaves 1.5-3k candidates, and fewer than k in a few percent of 768-long rows
// (k = 7) and under 1% of longer fibers.
inline double hint_decay(int64_t k) { return std::max(0.9, 1.0 - 0.15 / std::sqrt(static_cast<double>(k))); }

// The next call's hint from a fiber's k selected values: hint_decay(k) times its k-th key (0 if not finite).
template <typename A, typename T> double next_hint(const T* vo, int64_t k) {
  A kth = inf_of<A>();
  for (int64_t j = 0; j < k; ++j) kth = std::min(kth, key_of<A>(vo[j]));
  const double h = hint_decay(k) * static_cast<double>(kth);
  return std::isfinite(h) && h > 0 ? h : 0.0;
}

template <typename T, typename A>
int64_t hinted_pass_scalar(T* x, const T* g, int64_t n, A t, A* ckey, int64_t* cidx) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) {  // branch-free compaction
    if (g != nullptr) x[i] = add_as<T, A>(x[i], g[i]);
    const A v = key_of<A>(x[i]);
    ckey[c] = v;
    cidx[c] = i;
    c += v >= t;
  }
  return c;
}

#if HAT_X86_SIMD
// For every 8-lane mask: the passing lanes in ascending order, packed to the front (then zeros), and how many
// there are. One permute and one store then compact 8 keys (or their indices) without a branch.
struct CompactTable {
  alignas(32) int32_t perm[256][8];
  uint8_t count[256];
  CompactTable() {
    for (int m = 0; m < 256; ++m) {
      int o = 0;
      for (int l = 0; l < 8; ++l)
        if ((m >> l) & 1) perm[m][o++] = l;
      count[m] = static_cast<uint8_t>(o);
      for (; o < 8; ++o) perm[m][o] = 0;
    }
  }
};
const CompactTable kCompact;

// Stores the keys kv of the lanes set in mask m, and their positions base + lane as int32, at kp + n and
// ip + n (room for 8 more past n), packed in ascending lane order; n moves on by their count.
HAT_AVX2 inline void compact8(__m256 kv, int m, int64_t base, float* kp, int32_t* ip, int64_t& n) {
  const __m256i p = _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompact.perm[m]));
  _mm256_storeu_ps(kp + n, _mm256_permutevar8x32_ps(kv, p));
  const __m256i pos = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(base)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(ip + n), _mm256_permutevar8x32_epi32(pos, p));
  n += kCompact.count[m];
}

// hinted_pass_scalar on 8 entries at a time, with no data-dependent branch: every vector's passing keys and
// their indices are packed (kCompact) and stored at the candidates' end, which then moves by their count.
// ckey needs room for n + 8 keys, idx for n + 8 int32 indices (the fiber is shorter than 2^31); the
// candidates' indices are then widened into cidx.
template <typename T>
HAT_AVX2 int64_t hinted_pass_avx2(T* x, const T* g, int64_t n, float t, float* ckey, int64_t* cidx, int32_t* idx) {
  const __m256 tv = _mm256_set1_ps(t);
  const int64_t n8 = n - n % 8;
  int64_t c = 0;
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 kv = step8<T>(x + i, g != nullptr ? g + i : nullptr);
    compact8(kv, _mm256_movemask_ps(_mm256_cmp_ps(kv, tv, _CMP_GE_OQ)), i, ckey, idx, c);
  }
  for (int64_t i = n8; i < n; ++i) {
    if (g != nullptr) x[i] = add_as<T, float>(x[i], g[i]);
    const float v = key_of<float>(x[i]);
    ckey[c] = v;
    idx[c] = static_cast<int32_t>(i);
    c += v >= t;
  }
  for (int64_t j = 0; j < c; ++j) cidx[j] = idx[j];
  return c;
}
#endif

template <typename T, typename A>
int64_t hinted_pass(T* x, const T* g, int64_t n, A t, A* ckey, int64_t* cidx, int32_t* idx, bool simd) {
#if HAT_X86_SIMD
  if constexpr (HasLanes<T>::value) {
    if (simd && n < INT32_MAX) return hinted_pass_avx2<T>(x, g, n, t, ckey, cidx, idx);
  }
#endif
  return hinted_pass_scalar<T, A>(x, g, n, t, ckey, cidx);
}

// ---- all-dimension top-k -------------------------------------------------------------------------------

template <typename T>
void adtopk_rows(T* a, const T* g, int64_t rows, int64_t n, int64_t k, bool zero_sent, T* values, int64_t* local,
                 double* hint) {
  using A = typename AccOf<T>::type;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1));
  const bool direct = direct_select(n, k);
  const SamplePlan plan = direct && use_slabs() ? sample_plan(n, k) : SamplePlan();
  const bool simd = use_simd();
  const int64_t G = n / BLOCK;
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    Scratch<A> s;
    s.reserve(n);
    auto gm = buffer<A>(G);
    auto idx = buffer<int32_t>(hint != nullptr ? n + 8 : 0);
    A* ckey = s.ckey.get();
    int64_t* cidx = s.cidx.get();
    for (int64_t r = r0; r < r1; ++r) {
      T* x = a + r * n;
      int64_t* out = local + r * k;
      const T* gr = g != nullptr ? g + r * n : nullptr;
      int64_t c = 0;
      bool hinted = false;
      if (hint != nullptr && hint[r] > 0) {  // one fused pass against the hint; gr is then added
        c = hinted_pass<T, A>(x, gr, n, ceil_to<A>(hint[r]), ckey, cidx, idx.get(), simd);
        hinted = c >= k;
        gr = nullptr;
      }
      if (hinted) {
        // the candidates are those of the hinted pass
      } else if (direct) {
        if (gr != nullptr)
          for (int64_t i = 0; i < n; ++i) x[i] = add_as<T, A>(x[i], gr[i]);
        c = 0;
        if (plan.S > 0) {  // the entries reaching a sampled threshold, if at least k of them
          A* smp = s.tmp.get();
          for (int64_t q = 0; q < plan.S; ++q) smp[q] = key_of<A>(x[(q * n) / plan.S]);
          const A t = sample_threshold(smp, plan);
          for (int64_t i = 0; i < n; ++i) {  // branch-free compaction
            const A v = key_of<A>(x[i]);
            ckey[c] = v;
            cidx[c] = i;
            c += v >= t;
          }
        }
        if (c < k) {
          for (int64_t i = 0; i < n; ++i) {
            ckey[i] = key_of<A>(x[i]);
            cidx[i] = i;
          }
          c = n;
        }
      } else {
        pass_segment<T, A>(x, gr, n, gm.get(), simd);
        // The k-th largest group maximum t is a lower bound of the fiber's k-th largest key.
        const A t = group_threshold(gm.get(), G, k, s.tmp.get());
        const int64_t h = hit_groups(gm.get(), G, t, s.hits.get());
        c = scan_segment<A, T>(x, n, s.hits.get(), h, t, 0, ckey, cidx, 0);
      }
      finish(ckey, cidx, c, k, s.tmp.get(), out, simd);
      T* vo = values + r * k;
      for (int64_t j = 0; j < k; ++j) vo[j] = x[out[j]];
      if (hint != nullptr) hint[r] = next_hint<A>(vo, k);
      if (zero_sent)
        for (int64_t j = 0; j < k; ++j) x[out[j]] = static_cast<T>(0);
    }
  });
}

// One tile of NC adjacent columns (NC fixed at compile time on full tiles so the inner loops vectorise):
// walks the rows once, applies x += g, stores the keys densely (kbuf[i * TILE + c], so the rescan reads a
// compact, cache-resident buffer instead of rows far apart) and records, per block of BLOCK rows, the
// maximum key of every column (bm[b * TILE + c]).
constexpr int64_t TILE = 16;
constexpr int64_t PREFETCH_ROWS = 16;

template <typename T, typename A, int64_t NC>
void pass_tile(T* a, const T* g, int64_t rows, int64_t cols, int64_t c0, int64_t nc_rt, A* bm, A* kbuf) {
  const int64_t nc = NC > 0 ? NC : nc_rt;
  const int64_t nb = num_blocks(rows);
  for (int64_t b = 0; b < nb; ++b) {
    A m[TILE];
    for (int64_t c = 0; c < nc; ++c) m[c] = 0;
    const int64_t lo = b * BLOCK, hi = std::min(rows, lo + BLOCK);
    for (int64_t i = lo; i < hi; ++i) {
      T* __restrict x = a + i * cols + c0;
      // Rows are far apart (often more than a page), which hardware prefetchers do not follow: fetch ahead.
      if (i + PREFETCH_ROWS < rows) {
        __builtin_prefetch(x + PREFETCH_ROWS * cols, 1);
        if (g != nullptr) __builtin_prefetch(g + (i + PREFETCH_ROWS) * cols + c0, 0);
      }
      if (g != nullptr) {
        const T* __restrict gi = g + i * cols + c0;
        for (int64_t c = 0; c < nc; ++c) x[c] = add_as<T, A>(x[c], gi[c]);
      }
      A* __restrict kr = kbuf + i * TILE;
      for (int64_t c = 0; c < nc; ++c) {
        const A kv = key_of<A>(x[c]);
        kr[c] = kv;
        m[c] = m[c] > kv ? m[c] : kv;
      }
    }
    for (int64_t c = 0; c < nc; ++c) bm[b * TILE + c] = m[c];
  }
}

#if HAT_X86_SIMD
// pass_tile on a full tile of TILE = 16 columns, two 8-lane vectors per row (float keys only).
template <typename T>
HAT_AVX2 void pass_tile_avx2(T* a, const T* g, int64_t rows, int64_t cols, int64_t c0, float* bm, float* kbuf) {
  static_assert(TILE == 16, "pass_tile_avx2 handles 16 columns");
  const int64_t nb = num_blocks(rows);
  for (int64_t b = 0; b < nb; ++b) {
    __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
    const int64_t lo = b * BLOCK, hi = std::min(rows, lo + BLOCK);
    for (int64_t i = lo; i < hi; ++i) {
      T* x = a + i * cols + c0;
      const T* gi = g != nullptr ? g + i * cols + c0 : nullptr;
      if (i + PREFETCH_ROWS < rows) {
        __builtin_prefetch(x + PREFETCH_ROWS * cols, 1);
        if (gi != nullptr) __builtin_prefetch(gi + PREFETCH_ROWS * cols, 0);
      }
      const __m256 k0 = step8<T>(x, gi);
      const __m256 k1 = step8<T>(x + 8, gi != nullptr ? gi + 8 : nullptr);
      _mm256_storeu_ps(kbuf + i * TILE, k0);
      _mm256_storeu_ps(kbuf + i * TILE + 8, k1);
      m0 = _mm256_max_ps(m0, k0);
      m1 = _mm256_max_ps(m1, k1);
    }
    _mm256_storeu_ps(bm + b * TILE, m0);
    _mm256_storeu_ps(bm + b * TILE + 8, m1);
  }
}
#endif

// Full tiles through pass_tile_avx2 when simd (and T has float keys), else the scalar pass_tile.
template <typename T, typename A>
void pass_full_tile(T* a, const T* g, int64_t rows, int64_t cols, int64_t c0, A* bm, A* kbuf, bool simd) {
#if HAT_X86_SIMD
  if constexpr (HasLanes<T>::value) {
    if (simd) return pass_tile_avx2<T>(a, g, rows, cols, c0, bm, kbuf);
  }
#endif
  pass_tile<T, A, TILE>(a, g, rows, cols, c0, TILE, bm, kbuf);
}

template <typename T>
void adtopk_cols(T* a, const T* g, int64_t rows, int64_t cols, int64_t k, bool zero_sent, T* values, int64_t* local) {
  using A = typename AccOf<T>::type;
  const int64_t n = rows, nb = num_blocks(rows);
  const int64_t tiles = (cols + TILE - 1) / TILE;
  const bool direct = direct_select(n, k);
  const bool simd = use_simd();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const int64_t cap = n + BLOCK;
    auto ckey = buffer<A>(TILE * cap);
    auto cidx = buffer<int64_t>(TILE * cap);
    auto tmp = buffer<A>(cap);
    auto bm = buffer<A>(TILE * nb);
    auto col_bm = buffer<A>(nb);
    auto kbuf = buffer<A>(TILE * n);
    A thr[TILE];
    int64_t cnt[TILE], hit[TILE];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c0 = t * TILE, nc = std::min(TILE, cols - c0);
      if (nc == TILE)
        pass_full_tile<T, A>(a, g, rows, cols, c0, bm.get(), kbuf.get(), simd);
      else
        pass_tile<T, A, 0>(a, g, rows, cols, c0, nc, bm.get(), kbuf.get());
      for (int64_t c = 0; c < nc; ++c) {
        cnt[c] = 0;
        if (direct) {
          thr[c] = -inf_of<A>();
        } else {  // the k-th largest block maximum of the column bounds its k-th largest key from below
          for (int64_t b = 0; b < nb; ++b) col_bm[b] = bm[b * TILE + c];
          thr[c] = group_threshold(col_bm.get(), nb, k, tmp.get());
        }
      }
      // Rescan the tile block by block; in every block only the columns whose block maximum reaches their
      // threshold, compacting entries with key >= threshold (ascending rows per column).
      for (int64_t b = 0; b < nb; ++b) {
        int64_t nh = 0;
        for (int64_t c = 0; c < nc; ++c) {
          hit[nh] = c;
          nh += bm[b * TILE + c] >= thr[c];
        }
        if (nh == 0) continue;
        const int64_t lo = b * BLOCK, hi = std::min(rows, lo + BLOCK);
        for (int64_t i = lo; i < hi; ++i) {
          const A* kr = kbuf.get() + i * TILE;
          for (int64_t q = 0; q < nh; ++q) {
            const int64_t c = hit[q];
            const A v = kr[c];
            const int64_t o = c * cap + cnt[c];
            ckey[o] = v;
            cidx[o] = i;
            cnt[c] += v >= thr[c];
          }
        }
      }
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t f = c0 + c;
        int64_t* out = local + f * k;
        finish(ckey.get() + c * cap, cidx.get() + c * cap, cnt[c], k, tmp.get(), out, simd);
        T* vo = values + f * k;
        for (int64_t j = 0; j < k; ++j) vo[j] = a[out[j] * cols + f];
        if (zero_sent)
          for (int64_t j = 0; j < k; ++j) a[out[j] * cols + f] = static_cast<T>(0);
      }
    }
  });
}

// ---- column fibers in row-major passes ----------------------------------------------------------------
//
// Walking a tile of columns row by row touches a new page at every row once rows are a few KB long (a TLB
// miss per row and tile): on BERT / GPT shapes ([3072, 768], [30522, 768]) that cost 3-5x the r += g pass
// before any selection. When the fibers are long enough for block maxima (not direct), a slab of adjacent
// columns [c0, c1) (all of them on one thread) is selected from row-major passes instead, contiguous within
// every row:
//   1. x += g, and per block of BLOCK rows the maximum key of every column (bm[b * W + c]);
//   2. per column a threshold from its block maxima (group_threshold, as in adtopk_cols) and a capacity
//      (BLOCK entries per block that reaches the threshold);
//   3. a second row-major pass keeping every entry whose key reaches its column's threshold (ascending rows;
//      such an entry lies in a block that reaches it, so these are adtopk_cols's candidates exactly);
//   4. per column the exact selection among its candidates (finish).
// Same thresholds, same candidates in the same order: the same result as adtopk_cols, bit for bit. Where
// block maxima cannot bound the k-th key (direct_select), pass 1 only adds and each column's threshold is the
// sample_plan order statistic of its keys in S evenly spaced rows; a column that the candidate pass leaves
// with fewer than k takes all of its entries.

template <typename T, typename A>
void slab_maxima(T* a, const T* g, int64_t rows, int64_t cols, int64_t c0, int64_t W, A* bm) {
  const int64_t nb = num_blocks(rows);
  for (int64_t b = 0; b < nb; ++b) {
    A* __restrict m = bm + b * W;
    for (int64_t c = 0; c < W; ++c) m[c] = 0;
    for (int64_t i = b * BLOCK, hi = std::min(rows, b * BLOCK + BLOCK); i < hi; ++i) {
      T* __restrict x = a + i * cols + c0;
      if (g != nullptr) {
        const T* __restrict gi = g + i * cols + c0;
        for (int64_t c = 0; c < W; ++c) x[c] = add_as<T, A>(x[c], gi[c]);
      }
      for (int64_t c = 0; c < W; ++c) {
        const A kv = key_of<A>(x[c]);
        m[c] = m[c] > kv ? m[c] : kv;
      }
    }
  }
}

// x += g over a slab (what pass 1 does where a sampled threshold replaces the block maxima).
template <typename T, typename A>
void slab_add(T* a, const T* g, int64_t rows, int64_t cols, int64_t c0, int64_t W) {
  for (int64_t i = 0; i < rows; ++i) {
    T* __restrict x = a + i * cols + c0;
    const T* __restrict gi = g + i * cols + c0;
    for (int64_t c = 0; c < W; ++c) x[c] = add_as<T, A>(x[c], gi[c]);
  }
}

// The candidates of a slab, in row-major order as the second pass finds them: column and key (the caller
// records where each row's candidates begin).
template <typename A> struct SlabCandidates {
  std::unique_ptr<int32_t[]> col;
  std::unique_ptr<A[]> key;
  int64_t n = 0, cap = 0;  // cap > n: vector stores may run past the n candidates
  void reserve(int64_t m) {
    if (m <= cap) return;
    grow(col, m);
    grow(key, m);
    cap = m;
  }
  // Room for `extra` more candidates past n.
  void room(int64_t extra) {
    if (n + extra > cap) reserve(std::max(2 * cap, n + extra));
  }
  void add(int64_t c, A v) {
    room(1);
    col[n] = static_cast<int32_t>(c);
    key[n] = v;
    ++n;
  }

 private:
  template <typename U> void grow(std::unique_ptr<U[]>& p, int64_t m) {
    std::unique_ptr<U[]> q(new U[m]);  // left uninitialised: only [0, n) is read
    if (n > 0) std::copy(p.get(), p.get() + n, q.get());
    p = std::move(q);
  }
};

// Appends the entries of a row (x[0..W), columns c0 + c) whose key reaches thr[c].
template <typename T, typename A>
void slab_candidates_row(const T* x, int64_t W, int64_t c0, const A* thr, SlabCandidates<A>& out) {
  for (int64_t c = 0; c < W; ++c) {
    const A v = key_of<A>(x[c]);
    if (v >= thr[c]) out.add(c0 + c, v);
  }
}

#if HAT_X86_SIMD
// slab_maxima on 8 columns at a time (float keys only).
template <typename T>
HAT_AVX2 void slab_maxima_avx2(T* a, const T* g, int64_t rows, int64_t cols, int64_t c0, int64_t W, float* bm) {
  const int64_t nb = num_blocks(rows), W8 = W - W % 8;
  for (int64_t b = 0; b < nb; ++b) {
    float* m = bm + b * W;
    const int64_t lo = b * BLOCK, hi = std::min(rows, lo + BLOCK);
    for (int64_t i = lo; i < hi; ++i) {
      T* x = a + i * cols + c0;
      const T* gi = g != nullptr ? g + i * cols + c0 : nullptr;
      for (int64_t j = 0; j < W8; j += 8) {
        const __m256 kv = step8<T>(x + j, gi != nullptr ? gi + j : nullptr);
        _mm256_storeu_ps(m + j, i == lo ? kv : _mm256_max_ps(_mm256_loadu_ps(m + j), kv));
      }
      for (int64_t j = W8; j < W; ++j) {
        if (gi != nullptr) x[j] = add_as<T, float>(x[j], gi[j]);
        const float kv = key_of<float>(x[j]);
        m[j] = i == lo ? kv : (m[j] > kv ? m[j] : kv);
      }
    }
  }
}

// slab_add on 8 columns at a time (the sum rounded to T exactly as add_as does).
template <typename T>
HAT_AVX2 void slab_add_avx2(T* a, const T* g, int64_t rows, int64_t cols, int64_t c0, int64_t W) {
  const int64_t W8 = W - W % 8;
  for (int64_t i = 0; i < rows; ++i) {
    T* x = a + i * cols + c0;
    const T* gi = g + i * cols + c0;
    for (int64_t j = 0; j < W8; j += 8) Lanes<T>::store(x + j, _mm256_add_ps(Lanes<T>::load(x + j), Lanes<T>::load(gi + j)));
    for (int64_t j = W8; j < W; ++j) x[j] = add_as<T, float>(x[j], gi[j]);
  }
}

// The candidates among 8 entries of a row (keys kv, columns c .. c + 7) reaching thr[0..8), appended to out
// with no data-dependent branch; the caller made room.
HAT_AVX2 inline void slab_compact8(__m256 kv, const float* thr, int64_t c, SlabCandidates<float>& out) {
  compact8(kv, _mm256_movemask_ps(_mm256_cmp_ps(kv, _mm256_loadu_ps(thr), _CMP_GE_OQ)), c, out.key.get(),
           out.col.get(), out.n);
}

// slab_candidates_row on 8 columns at a time (float keys).
template <typename T>
HAT_AVX2 void slab_candidates_row_avx2(const T* x, int64_t W, int64_t c0, const float* thr,
                                       SlabCandidates<float>& out) {
  const int64_t W8 = W - W % 8;
  out.room(W8 + 8);
  for (int64_t j = 0; j < W8; j += 8) slab_compact8(keys8(Lanes<T>::load(x + j)), thr + j, c0 + j, out);
  slab_candidates_row<T, float>(x + W8, W - W8, c0 + W8, thr + W8, out);
}

// slab_candidates_row_avx2 fused with x += g: the sums are stored, their keys compared with thr.
template <typename T>
HAT_AVX2 void slab_step_candidates_row_avx2(T* x, const T* g, int64_t W, int64_t c0, const float* thr,
                                            SlabCandidates<float>& out) {
  const int64_t W8 = W - W % 8;
  out.room(W8 + 8);
  for (int64_t j = 0; j < W8; j += 8) slab_compact8(step8<T>(x + j, g + j), thr + j, c0 + j, out);
  for (int64_t j = W8; j < W; ++j) x[j] = add_as<T, float>(x[j], g[j]);
  slab_candidates_row<T, float>(x + W8, W - W8, c0 + W8, thr + W8, out);
}
#endif

template <typename T>
void adtopk_cols_slabs(T* a, const T* g, int64_t rows, int64_t cols, int64_t k, bool zero_sent, T* values,
                       int64_t* local, const SamplePlan& plan, double* hint) {
  using A = typename AccOf<T>::type;
  const int64_t nb = num_blocks(rows);
  const bool simd = use_simd();
  at::parallel_for(0, cols, 64, [&](int64_t c0, int64_t c1) {
    const int64_t W = c1 - c0;
    // 1. x += g, with the block maxima where they give the thresholds; 2. per column its threshold.
    const bool vec = simd && HasLanes<T>::value;
    auto thr = buffer<A>(W), tmp = buffer<A>(std::max<int64_t>(rows, 256) + BLOCK);
    bool hinted = hint != nullptr;  // every column of the slab has a hint: they are the thresholds
    for (int64_t c = 0; hinted && c < W; ++c) hinted = hint[c0 + c] > 0;
    const bool fused = hinted && vec && g != nullptr;  // x += g in the candidate pass below
    if (hinted) {
      if (g != nullptr && !fused) slab_add<T, A>(a, g, rows, cols, c0, W);
      for (int64_t c = 0; c < W; ++c) thr[c] = ceil_to<A>(hint[c0 + c]);
    } else if (plan.S == 0) {  // at least k of the column's block maxima reach its threshold
      auto bm = buffer<A>(nb * W);
#if HAT_X86_SIMD
      if constexpr (HasLanes<T>::value) {
        if (vec) slab_maxima_avx2<T>(a, g, rows, cols, c0, W, bm.get());
      }
#endif
      if (!vec) slab_maxima<T, A>(a, g, rows, cols, c0, W, bm.get());
      auto bmt = buffer<A>(nb * W);  // transposed: each column's maxima contiguous
      for (int64_t b0 = 0; b0 < nb; b0 += BLOCK)
        for (int64_t c = 0; c < W; ++c)
          for (int64_t b = b0, be = std::min(nb, b0 + BLOCK); b < be; ++b) bmt[c * nb + b] = bm[b * W + c];
      for (int64_t c = 0; c < W; ++c) thr[c] = group_threshold(bmt.get() + c * nb, nb, k, tmp.get());
    } else {  // from the keys of S evenly spaced rows (checked by counting below)
      if (g != nullptr) {
#if HAT_X86_SIMD
        if constexpr (HasLanes<T>::value) {
          if (vec) slab_add_avx2<T>(a, g, rows, cols, c0, W);
        }
#endif
        if (!vec) slab_add<T, A>(a, g, rows, cols, c0, W);
      }
      auto smp = buffer<A>(plan.S * W);
      for (int64_t q = 0; q < plan.S; ++q) {
        const T* x = a + ((q * rows) / plan.S) * cols + c0;
        for (int64_t c = 0; c < W; ++c) smp[c * plan.S + q] = key_of<A>(x[c]);
      }
      for (int64_t c = 0; c < W; ++c) thr[c] = sample_threshold(smp.get() + c * plan.S, plan);
    }
    // 3. the candidates, row-major, then grouped by column (a stable counting sort keeps rows ascending).
    SlabCandidates<A> cand;
    cand.reserve(W * ((hinted ? 3 * k : k + k / 2) + BLOCK));
    auto row_start = buffer<int64_t>(rows + 1);  // row i's candidates are [row_start[i], row_start[i + 1])
    for (int64_t i = 0; i < rows; ++i) {
      const T* x = a + i * cols + c0;
      row_start[i] = cand.n;
#if HAT_X86_SIMD
      if constexpr (HasLanes<T>::value) {
        if (fused) {
          slab_step_candidates_row_avx2<T>(a + i * cols + c0, g + i * cols + c0, W, c0, thr.get(), cand);
          continue;
        }
        if (vec) {
          slab_candidates_row_avx2<T>(x, W, c0, thr.get(), cand);
          continue;
        }
      }
#endif
      slab_candidates_row<T, A>(x, W, c0, thr.get(), cand);
    }
    const int64_t total = cand.n;
    row_start[rows] = total;
    auto off = buffer<int64_t>(W + 1), fill = buffer<int64_t>(W);
    std::fill(off.get(), off.get() + W + 1, 0);
    for (int64_t q = 0; q < total; ++q) ++off[cand.col[q] - c0 + 1];
    for (int64_t c = 0; c < W; ++c) off[c + 1] += off[c];
    std::copy(off.get(), off.get() + W, fill.get());
    auto ckey = buffer<A>(total);
    auto cidx = buffer<int64_t>(total);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t q = row_start[i]; q < row_start[i + 1]; ++q) {
        const int64_t o = fill[cand.col[q] - c0]++;
        ckey[o] = cand.key[q];
        cidx[o] = i;
      }
    // 4. the exact top-k of every column among its candidates (all of its entries where a sampled threshold
    // or a hint left fewer than k).
    std::unique_ptr<A[]> fkey;
    std::unique_ptr<int64_t[]> fidx;
    for (int64_t c = 0; c < W; ++c) {
      const int64_t f = c0 + c;
      int64_t* out = local + f * k;
      if (off[c + 1] - off[c] >= k) {
        finish(ckey.get() + off[c], cidx.get() + off[c], off[c + 1] - off[c], k, tmp.get(), out, simd);
      } else {
        if (!fkey) {
          fkey = buffer<A>(rows);
          fidx = buffer<int64_t>(rows);
        }
        for (int64_t i = 0; i < rows; ++i) {
          fkey[i] = key_of<A>(a[i * cols + f]);
          fidx[i] = i;
        }
        finish(fkey.get(), fidx.get(), rows, k, tmp.get(), out, simd);
      }
      T* vo = values + f * k;
      for (int64_t j = 0; j < k; ++j) vo[j] = a[out[j] * cols + f];
      if (hint != nullptr) hint[f] = next_hint<A>(vo, k);
      if (zero_sent)
        for (int64_t j = 0; j < k; ++j) a[out[j] * cols + f] = static_cast<T>(0);
    }
  });
}

void check_input(const at::Tensor& a, const c10::optional<at::Tensor>& grad) {
  TORCH_CHECK(a.device().is_cpu(), "horovod_adtopk._C: expected a CPU tensor");
  TORCH_CHECK(a.is_contiguous(), "horovod_adtopk._C: expected a contiguous tensor");
  if (grad.has_value()) {
    const at::Tensor& g = *grad;
    TORCH_CHECK(g.device().is_cpu() && g.is_contiguous() && g.scalar_type() == a.scalar_type() &&
                    g.numel() == a.numel(),
                "horovod_adtopk._C: grad must be a contiguous CPU tensor of a's dtype and size");
  }
}

std::vector<at::Tensor> adtopk_select(at::Tensor a, int64_t rows, int64_t cols, int64_t axis, int64_t k,
                                      c10::optional<at::Tensor> grad, bool zero_sent, c10::optional<at::Tensor> hint) {
  check_input(a, grad);
  TORCH_CHECK(rows >= 0 && cols >= 0 && rows * cols == a.numel(), "horovod_adtopk._C: rows * cols != numel");
  TORCH_CHECK(axis == 0 || axis == 1, "horovod_adtopk._C: axis must be 0 or 1");
  const int64_t n = axis == 1 ? cols : rows, nf = axis == 1 ? rows : cols;
  TORCH_CHECK(k >= 1 && k <= n, "horovod_adtopk._C: need 1 <= k <= fiber length");
  double* hp = nullptr;  // rows and the column slabs use it; the tiled column walk leaves it as it is
  if (hint.has_value()) {
    const at::Tensor& h = *hint;
    TORCH_CHECK(h.scalar_type() == at::kDouble && h.device().is_cpu() && h.is_contiguous() && h.numel() == nf,
                "horovod_adtopk._C: hint must be a contiguous CPU float64 tensor of num_fibers entries");
    hp = h.data_ptr<double>();
  }
  at::Tensor values = at::empty({nf, k}, a.options());
  at::Tensor local = at::empty({nf, k}, a.options().dtype(at::kLong));
  // Column fibers where block maxima cannot bound the k-th key: a threshold from a sample of their keys.
  const SamplePlan col_plan = axis == 0 && direct_select(rows, k) ? sample_plan(rows, k) : SamplePlan();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "adtopk_select", [&] {
    scalar_t* ap = a.data_ptr<scalar_t>();
    const scalar_t* gp = grad.has_value() ? grad->data_ptr<scalar_t>() : nullptr;
    if (axis == 1)
      adtopk_rows<scalar_t>(ap, gp, rows, cols, k, zero_sent, values.data_ptr<scalar_t>(), local.data_ptr<int64_t>(),
                            hp);
    else if (!use_slabs() || (direct_select(rows, k) && col_plan.S == 0))
      adtopk_cols<scalar_t>(ap, gp, rows, cols, k, zero_sent, values.data_ptr<scalar_t>(), local.data_ptr<int64_t>());
    else
      adtopk_cols_slabs<scalar_t>(ap, gp, rows, cols, k, zero_sent, values.data_ptr<scalar_t>(),
                                  local.data_ptr<int64_t>(), col_plan, hp);
  });
  return {values, local};
}

// ---- global top-k --------------------------------------------------------------------------------------

template <typename T>
void topk_flat(T* a, const T* g, int64_t n, int64_t k, bool zero_sent, at::Tensor& values_out, at::Tensor& flat_out) {
  using A = typename AccOf<T>::type;
  // Chunks of CHUNK entries, each a segment with CHUNK / BLOCK interleaved groups (its maxima stay in cache).
  constexpr int64_t GPC = 4096, CHUNK = GPC * BLOCK;
  const int64_t nch = (n + CHUNK - 1) / CHUNK;
  auto chunk_len = [&](int64_t q) { return std::min(CHUNK, n - q * CHUNK); };
  const int64_t ng = (nch - 1) * GPC + chunk_len(nch - 1) / BLOCK;  // groups overall (chunk q's at q * GPC)
  auto gm = buffer<A>(nch * GPC);
  const bool simd = use_simd();
  at::parallel_for(0, nch, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q)
      pass_segment<T, A>(a + q * CHUNK, g ? g + q * CHUNK : nullptr, chunk_len(q), gm.get() + q * GPC, simd);
  });

  // Threshold on the group maxima: any t with at least k maxima >= t is a valid lower bound of the k-th
  // largest key. Estimate a tight one from a strided sample of the maxima, check it by counting, and lower
  // it until the count is reached (finally -inf: everything). Exactness never depends on the sample.
  A t = -inf_of<A>();
  if (!direct_select(n, k) && ng >= k) {
    const int64_t S = std::min<int64_t>(ng, 16384);
    auto sample = buffer<A>(S);
    auto group = [&](int64_t i) { return gm[(i / GPC) * GPC + i % GPC]; };  // i-th group overall
    for (int64_t i = 0; i < S; ++i) sample[i] = group((i * ng) / S);
    std::sort(sample.get(), sample.get() + S, std::greater<A>());
    const double expect = static_cast<double>(k) * S / ng;
    int64_t j = static_cast<int64_t>(std::ceil(expect + 4.0 * std::sqrt(expect) + 4.0));
    while (j <= S) {
      const A cand = sample[j - 1];
      const int64_t cnt = at::parallel_reduce(
          0, nch, 1, int64_t(0),
          [&](int64_t q0, int64_t q1, int64_t acc) {
            for (int64_t q = q0; q < q1; ++q) {
              const A* gq = gm.get() + q * GPC;
              int32_t c = 0;
              for (int64_t i = 0, e = chunk_len(q) / BLOCK; i < e; ++i) c += gq[i] >= cand;
              acc += c;
            }
            return acc;
          },
          std::plus<int64_t>());
      if (cnt >= k) {
        t = cand;
        break;
      }
      j *= 4;
    }
  }

  // Candidates: entries with key >= t of the groups whose maximum is >= t (and chunk tails), per part.
  const int64_t parts = std::min<int64_t>(nch, 256);
  std::vector<std::vector<A>> ckeys(parts);
  std::vector<std::vector<int64_t>> cidxs(parts);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    std::vector<int64_t> hits(GPC + 1);
    for (int64_t p = p0; p < p1; ++p) {
      std::vector<A>& ck = ckeys[p];
      std::vector<int64_t>& ci = cidxs[p];
      int64_t c = 0;
      for (int64_t q = nch * p / parts; q < nch * (p + 1) / parts; ++q) {
        const int64_t L = chunk_len(q);
        const int64_t h = hit_groups(gm.get() + q * GPC, L / BLOCK, t, hits.data());
        const int64_t need = c + h * BLOCK + BLOCK;
        if (static_cast<int64_t>(ck.size()) < need) {
          ck.resize(std::max<int64_t>(need, 2 * static_cast<int64_t>(ck.size())));
          ci.resize(ck.size());
        }
        c = scan_segment<A, T>(a + q * CHUNK, L, hits.data(), h, t, q * CHUNK, ck.data(), ci.data(), c);
      }
      ck.resize(c);
      ci.resize(c);
    }
  });
  int64_t total = 0;
  for (const auto& ck : ckeys) total += static_cast<int64_t>(ck.size());
  auto allk = buffer<A>(total);
  auto alli = buffer<int64_t>(total);
  int64_t off = 0;
  for (int64_t p = 0; p < parts; ++p) {
    std::copy(ckeys[p].begin(), ckeys[p].end(), allk.get() + off);
    std::copy(cidxs[p].begin(), cidxs[p].end(), alli.get() + off);
    off += static_cast<int64_t>(ckeys[p].size());
    std::vector<A>().swap(ckeys[p]);
    std::vector<int64_t>().swap(cidxs[p]);
  }
  auto tmp = buffer<A>(total);
  int64_t* out = flat_out.data_ptr<int64_t>();
  finish(allk.get(), alli.get(), total, k, tmp.get(), out);
  T* vo = values_out.data_ptr<T>();
  for (int64_t j = 0; j < k; ++j) vo[j] = a[out[j]];
  if (zero_sent)
    for (int64_t j = 0; j < k; ++j) a[out[j]] = static_cast<T>(0);
}

std::vector<at::Tensor> topk_select(at::Tensor a, int64_t k, c10::optional<at::Tensor> grad, bool zero_sent) {
  check_input(a, grad);
  const int64_t n = a.numel();
  TORCH_CHECK(k >= 1 && k <= n, "horovod_adtopk._C: need 1 <= k <= numel");
  at::Tensor values = at::empty({k}, a.options());
  at::Tensor flat = at::empty({k}, a.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "topk_select", [&] {
    topk_flat<scalar_t>(a.data_ptr<scalar_t>(), grad.has_value() ? grad->data_ptr<scalar_t>() : nullptr, n, k,
                        zero_sent, values, flat);
  });
  return {values, flat};
}

// ---- thresholds ----------------------------------------------------------------------------------------

// Entries of rows [r0, r1) of a rows x cols matrix passing their threshold: thr(r, c) gives it.
template <typename T, typename A, typename ThrFn>
int64_t count_rows(const T* a, int64_t cols, int64_t r0, int64_t r1, ThrFn thr) {
  int64_t cnt = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = a + r * cols;
    for (int64_t c = 0; c < cols; ++c) cnt += passes<A>(key_of<A>(x[c]), thr(r, c));
  }
  return cnt;
}

// Two passes over row chunks: count, then write (values, flat indices) in ascending flat order.
template <typename T, typename A, typename ThrFn>
std::vector<at::Tensor> select_where(const at::Tensor& at_a, int64_t rows, int64_t cols, ThrFn thr) {
  const T* a = at_a.data_ptr<T>();
  const int64_t grain_rows = std::max<int64_t>(1, 65536 / std::max<int64_t>(cols, 1));
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(1024, (rows + grain_rows - 1) / grain_rows));
  std::vector<int64_t> counts(chunks + 1, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q)
      counts[q + 1] = count_rows<T, A>(a, cols, rows * q / chunks, rows * (q + 1) / chunks, thr);
  });
  for (int64_t q = 0; q < chunks; ++q) counts[q + 1] += counts[q];
  at::Tensor values = at::empty({counts[chunks]}, at_a.options());
  at::Tensor flat = at::empty({counts[chunks]}, at_a.options().dtype(at::kLong));
  T* vo = values.data_ptr<T>();
  int64_t* io = flat.data_ptr<int64_t>();
  at::parallel_for(0, chunks, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      int64_t o = counts[q];
      for (int64_t r = rows * q / chunks; r < rows * (q + 1) / chunks; ++r) {
        const T* x = a + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          if (passes<A>(key_of<A>(x[c]), thr(r, c))) {
            vo[o] = x[c];
            io[o] = r * cols + c;
            ++o;
          }
        }
      }
    }
  });
  return {values, flat};
}

// Entries of x[i0..i1) passing tf (32-bit partial counts keep the loop vectorisable).
template <typename T, typename A> int64_t count_range(const T* x, int64_t i0, int64_t i1, A tf) {
  int64_t total = 0;
  for (int64_t s = i0; s < i1; s += (1 << 20)) {
    const int64_t e = std::min(i1, s + (1 << 20));
    int32_t c = 0;
    for (int64_t i = s; i < e; ++i) c += passes<A>(key_of<A>(x[i]), tf);
    total += c;
  }
  return total;
}

// Flat version: entries of a[0..n) with key passing tf, chunked over flat ranges.
template <typename T, typename A>
std::vector<at::Tensor> select_flat(const at::Tensor& at_a, A tf) {
  const T* a = at_a.data_ptr<T>();
  const int64_t n = at_a.numel();
  constexpr int64_t GRAIN = 65536;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(1024, (n + GRAIN - 1) / GRAIN));
  std::vector<int64_t> counts(chunks + 1, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      int64_t cnt = 0;
      cnt = count_range<T, A>(a, n * q / chunks, n * (q + 1) / chunks, tf);
      counts[q + 1] = cnt;
    }
  });
  for (int64_t q = 0; q < chunks; ++q) counts[q + 1] += counts[q];
  at::Tensor values = at::empty({counts[chunks]}, at_a.options());
  at::Tensor flat = at::empty({counts[chunks]}, at_a.options().dtype(at::kLong));
  T* vo = values.data_ptr<T>();
  int64_t* io = flat.data_ptr<int64_t>();
  at::parallel_for(0, chunks, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      int64_t o = counts[q];
      for (int64_t i = n * q / chunks; i < n * (q + 1) / chunks; ++i) {
        if (passes<A>(key_of<A>(a[i]), tf)) {
          vo[o] = a[i];
          io[o] = i;
          ++o;
        }
      }
    }
  });
  return {values, flat};
}

std::vector<at::Tensor> threshold_select(at::Tensor a, double t) {
  check_input(a, c10::nullopt);
  std::vector<at::Tensor> res;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "threshold_select", [&] {
    using A = typename AccOf<scalar_t>::type;
    res = select_flat<scalar_t, A>(a, ceil_to<A>(t));
  });
  return res;
}

int64_t count_at_least(at::Tensor a, double t) {
  check_input(a, c10::nullopt);
  int64_t total = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "count_at_least", [&] {
    using A = typename AccOf<scalar_t>::type;
    const A tf = ceil_to<A>(t);
    const scalar_t* x = a.data_ptr<scalar_t>();
    total = at::parallel_reduce(
        0, a.numel(), 1 << 16, int64_t(0),
        [&](int64_t i0, int64_t i1, int64_t acc) {
          return acc + count_range<scalar_t, A>(x, i0, i1, tf);
        },
        std::plus<int64_t>());
  });
  return total;
}

std::vector<at::Tensor> fiber_threshold_select(at::Tensor a, int64_t rows, int64_t cols, int64_t axis,
                                               at::Tensor thresholds) {
  check_input(a, c10::nullopt);
  TORCH_CHECK(rows >= 0 && cols >= 0 && rows * cols == a.numel(), "horovod_adtopk._C: rows * cols != numel");
  TORCH_CHECK(axis == 0 || axis == 1, "horovod_adtopk._C: axis must be 0 or 1");
  const int64_t nf = axis == 1 ? rows : cols;
  TORCH_CHECK(thresholds.scalar_type() == at::kDouble && thresholds.device().is_cpu() &&
                  thresholds.is_contiguous() && thresholds.numel() == nf,
              "horovod_adtopk._C: thresholds must be a contiguous CPU float64 tensor of num_fibers entries");
  std::vector<at::Tensor> res;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "fiber_threshold_select", [&] {
    using A = typename AccOf<scalar_t>::type;
    const double* tp = thresholds.data_ptr<double>();
    std::vector<A> tf(nf);
    for (int64_t f = 0; f < nf; ++f) tf[f] = ceil_to<A>(tp[f]);
    const A* tv = tf.data();
    if (axis == 1)
      res = select_where<scalar_t, A>(a, rows, cols, [tv](int64_t r, int64_t) { return tv[r]; });
    else
      res = select_where<scalar_t, A>(a, rows, cols, [tv](int64_t, int64_t c) { return tv[c]; });
  });
  return res;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Native CPU selection kernels of horovod_adtopk (use horovod_adtopk.kernels)";
  m.def("adtopk_select", &adtopk_select, "Per-fiber exact top-k of |a| (optionally a += grad first)",
        py::arg("a"), py::arg("rows"), py::arg("cols"), py::arg("axis"), py::arg("k"), py::arg("grad") = py::none(),
        py::arg("zero_sent") = false, py::arg("hint") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("topk_select", &topk_select, "Exact global top-k of |a|", py::arg("a"), py::arg("k"),
        py::arg("grad") = py::none(), py::arg("zero_sent") = false, py::call_guard<py::gil_scoped_release>());
  m.def("simd_path", &simd_path,
        "The first-pass code a call would take now: 'avx2' (CPU with AVX2 + F16C, HOROVOD_ADTOPK_SIMD not 0) or "
        "'scalar'");
  m.def("threshold_select", &threshold_select, "Entries with |a| >= t or non-finite", py::arg("a"), py::arg("t"));
  m.def("count_at_least", &count_at_least, "Number of entries with |a| >= t or non-finite", py::arg("a"),
        py::arg("t"));
  m.def("fiber_threshold_select", &fiber_threshold_select, "Entries reaching their fiber's threshold",
        py::arg("a"), py::arg("rows"), py::arg("cols"), py::arg("axis"), py::arg("thresholds"));
}
