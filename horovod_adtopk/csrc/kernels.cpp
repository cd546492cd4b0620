// Native CPU selection kernels for horovod_adtopk (the extension module horovod_adtopk._C).
//
// Every selection ranks entries by the key |x| with NaN mapped to +inf (so NaN and +-Inf rank above every
// finite magnitude). Keys are compared as float (fp16 / bf16 / fp32 inputs, all exactly representable) or
// double (fp64 inputs).
//
// Exact top-k of a fiber without sorting it
// -----------------------------------------
// The fiber is cut into blocks of BLOCK consecutive entries and the maximum key of every block is recorded
// during the first pass over the data (fused with the error-feedback add ``a += grad``). If t is the k-th
// largest block maximum, the k blocks whose maxima are >= t hold k distinct entries >= t, so the k-th
// largest key of the fiber is >= t: every entry of the top-k has key >= t and lies in a block whose maximum
// is >= t. Only those blocks are scanned again (about k of them), their entries with key >= t are compacted
// as candidates (typically about 1.1 k), and an exact selection among the candidates finishes the job. The
// threshold never depends on a random sample, so the result is always exact. Ties at the k-th key are
// resolved towards the lower index, and positions come out in ascending order.
//
// When k is a large share of the fiber (too few blocks per kept entry) all entries are candidates.

#include <torch/extension.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <vector>

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

// The smallest A >= t (exact comparison of A keys against a double threshold); NaN stays NaN.
template <typename A> A ceil_to(double t) {
  if (std::isnan(t)) return std::numeric_limits<A>::quiet_NaN();
  if (t > static_cast<double>(std::numeric_limits<A>::max())) return inf_of<A>();
  if (t < -static_cast<double>(std::numeric_limits<A>::max())) return -inf_of<A>();
  A f = static_cast<A>(t);
  if (static_cast<double>(f) < t) f = std::nextafter(f, inf_of<A>());
  return f;
}

template <typename A> inline bool passes(A key, A t) { return (key >= t) | (key == inf_of<A>()); }

template <typename U> std::unique_ptr<U[]> buffer(int64_t n) { return std::unique_ptr<U[]>(new U[std::max<int64_t>(n, 1)]); }

inline int64_t num_blocks(int64_t n) { return (n + BLOCK - 1) / BLOCK; }

// Whether a fiber of length n keeping k goes straight to an exact selection over all entries.
inline bool direct_select(int64_t n, int64_t k) { return n < 4 * BLOCK || k * 4 * BLOCK > n; }

// Per-thread scratch for fiber selection.
template <typename A> struct Scratch {
  int64_t cap = 0;
  std::unique_ptr<A[]> tmp, ckey;
  std::unique_ptr<int64_t[]> cidx;
  void reserve(int64_t n) {
    if (n + BLOCK <= cap) return;
    cap = n + BLOCK;
    tmp = buffer<A>(cap);
    ckey = buffer<A>(cap);
    cidx = buffer<int64_t>(cap);
  }
};

// The k-th largest of v[0..c) (v is copied into tmp).
template <typename A> A kth_largest(const A* v, int64_t c, int64_t k, A* tmp) {
  std::copy(v, v + c, tmp);
  std::nth_element(tmp, tmp + (k - 1), tmp + c, std::greater<A>());
  return tmp[k - 1];
}

// Final step: among candidates (ckey, cidx) in ascending index order, at least k of them, write the top-k
// positions in ascending order to out; ties at the k-th key go to the lower index.
template <typename A> void finish(const A* ckey, const int64_t* cidx, int64_t c, int64_t k, A* tmp, int64_t* out) {
  if (c == k) {
    std::copy(cidx, cidx + c, out);
    return;
  }
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

// Exact top-k positions (ascending) of one fiber of length n. key(i) gives the key of entry i; bm holds the
// block maxima (ignored on the direct path).
template <typename A, typename KeyFn>
void select_fiber(int64_t n, int64_t k, KeyFn key, const A* bm, Scratch<A>& s, int64_t* out) {
  A* ckey = s.ckey.get();
  int64_t* cidx = s.cidx.get();
  int64_t c = 0;
  if (direct_select(n, k)) {
    for (int64_t i = 0; i < n; ++i) {
      ckey[i] = key(i);
      cidx[i] = i;
    }
    c = n;
  } else {
    const int64_t nb = num_blocks(n);
    const A t = kth_largest(bm, nb, k, s.tmp.get());
    for (int64_t b = 0; b < nb; ++b) {
      if (bm[b] < t) continue;
      const int64_t lo = b * BLOCK, hi = std::min(n, lo + BLOCK);
      for (int64_t i = lo; i < hi; ++i) {  // branch-free compaction (buffers have BLOCK slack)
        const A v = key(i);
        ckey[c] = v;
        cidx[c] = i;
        c += v >= t;
      }
    }
  }
  finish(ckey, cidx, c, k, s.tmp.get(), out);
}

// ---- all-dimension top-k -------------------------------------------------------------------------------

// First pass over a contiguous run x[0..n) (optionally x += g): block maxima of the keys into bm.
template <typename T, typename A> void pass_contiguous(T* x, const T* g, int64_t n, A* bm) {
  const int64_t full = n / BLOCK;
  if (g != nullptr) {
    for (int64_t b = 0; b < full; ++b) {
      T* xb = x + b * BLOCK;
      const T* gb = g + b * BLOCK;
      A m = 0;
      for (int64_t i = 0; i < BLOCK; ++i) {
        const T v = static_cast<T>(static_cast<A>(xb[i]) + static_cast<A>(gb[i]));
        xb[i] = v;
        const A kv = key_of<A>(v);
        m = m > kv ? m : kv;
      }
      bm[b] = m;
    }
  } else {
    for (int64_t b = 0; b < full; ++b) {
      const T* xb = x + b * BLOCK;
      A m = 0;
      for (int64_t i = 0; i < BLOCK; ++i) {
        const A kv = key_of<A>(xb[i]);
        m = m > kv ? m : kv;
      }
      bm[b] = m;
    }
  }
  if (full * BLOCK < n) {
    A m = 0;
    for (int64_t i = full * BLOCK; i < n; ++i) {
      if (g != nullptr) x[i] = static_cast<T>(static_cast<A>(x[i]) + static_cast<A>(g[i]));
      const A kv = key_of<A>(x[i]);
      m = m > kv ? m : kv;
    }
    bm[full] = m;
  }
}

template <typename T>
void adtopk_rows(T* a, const T* g, int64_t rows, int64_t n, int64_t k, bool zero_sent, T* values, int64_t* local) {
  using A = typename AccOf<T>::type;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    Scratch<A> s;
    s.reserve(n);
    auto bm = buffer<A>(num_blocks(n));
    for (int64_t r = r0; r < r1; ++r) {
      T* x = a + r * n;
      pass_contiguous<T, A>(x, g ? g + r * n : nullptr, n, bm.get());
      int64_t* out = local + r * k;
      select_fiber<A>(n, k, [x](int64_t i) { return key_of<A>(x[i]); }, bm.get(), s, out);
      T* vo = values + r * k;
      for (int64_t j = 0; j < k; ++j) vo[j] = x[out[j]];
      if (zero_sent)
        for (int64_t j = 0; j < k; ++j) x[out[j]] = static_cast<T>(0);
    }
  });
}

// One tile of NC adjacent columns (NC known at compile time on full tiles so the inner loops vectorise):
// walks the rows once, applies x += g, stores the keys transposed (kbuf[c * rows + i]) and the block maxima
// of every column (bm[c * nb + b]).
template <typename T, typename A, int64_t NC>
void pass_tile(T* a, const T* g, int64_t rows, int64_t cols, int64_t c0, int64_t nc_rt, A* kbuf, A* bm) {
  const int64_t nc = NC > 0 ? NC : nc_rt;
  const int64_t nb = num_blocks(rows);
  A m[64];
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t c = 0; c < nc; ++c) m[c] = 0;
    const int64_t lo = b * BLOCK, hi = std::min(rows, lo + BLOCK);
    for (int64_t i = lo; i < hi; ++i) {
      T* x = a + i * cols + c0;
      if (g != nullptr) {
        const T* gi = g + i * cols + c0;
        for (int64_t c = 0; c < nc; ++c) x[c] = static_cast<T>(static_cast<A>(x[c]) + static_cast<A>(gi[c]));
      }
      for (int64_t c = 0; c < nc; ++c) {
        const A kv = key_of<A>(x[c]);
        kbuf[c * rows + i] = kv;
        m[c] = m[c] > kv ? m[c] : kv;
      }
    }
    for (int64_t c = 0; c < nc; ++c) bm[c * nb + b] = m[c];
  }
}

template <typename T>
void adtopk_cols(T* a, const T* g, int64_t rows, int64_t cols, int64_t k, bool zero_sent, T* values, int64_t* local) {
  using A = typename AccOf<T>::type;
  constexpr int64_t TILE = 16;
  const int64_t n = rows, nb = num_blocks(rows);
  const int64_t tiles = (cols + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    Scratch<A> s;
    s.reserve(n);
    auto kbuf = buffer<A>(TILE * n);
    auto bm = buffer<A>(TILE * nb);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c0 = t * TILE, nc = std::min(TILE, cols - c0);
      if (nc == TILE)
        pass_tile<T, A, TILE>(a, g, rows, cols, c0, nc, kbuf.get(), bm.get());
      else
        pass_tile<T, A, 0>(a, g, rows, cols, c0, nc, kbuf.get(), bm.get());
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t f = c0 + c;
        const A* kc = kbuf.get() + c * n;
        int64_t* out = local + f * k;
        select_fiber<A>(n, k, [kc](int64_t i) { return kc[i]; }, bm.get() + c * nb, s, out);
        T* vo = values + f * k;
        for (int64_t j = 0; j < k; ++j) vo[j] = a[out[j] * cols + f];
        if (zero_sent)
          for (int64_t j = 0; j < k; ++j) a[out[j] * cols + f] = static_cast<T>(0);
      }
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
                                      c10::optional<at::Tensor> grad, bool zero_sent) {
  check_input(a, grad);
  TORCH_CHECK(rows >= 0 && cols >= 0 && rows * cols == a.numel(), "horovod_adtopk._C: rows * cols != numel");
  TORCH_CHECK(axis == 0 || axis == 1, "horovod_adtopk._C: axis must be 0 or 1");
  const int64_t n = axis == 1 ? cols : rows, nf = axis == 1 ? rows : cols;
  TORCH_CHECK(k >= 1 && k <= n, "horovod_adtopk._C: need 1 <= k <= fiber length");
  at::Tensor values = at::empty({nf, k}, a.options());
  at::Tensor local = at::empty({nf, k}, a.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "adtopk_select", [&] {
    scalar_t* ap = a.data_ptr<scalar_t>();
    const scalar_t* gp = grad.has_value() ? grad->data_ptr<scalar_t>() : nullptr;
    if (axis == 1)
      adtopk_rows<scalar_t>(ap, gp, rows, cols, k, zero_sent, values.data_ptr<scalar_t>(), local.data_ptr<int64_t>());
    else
      adtopk_cols<scalar_t>(ap, gp, rows, cols, k, zero_sent, values.data_ptr<scalar_t>(), local.data_ptr<int64_t>());
  });
  return {values, local};
}

// ---- global top-k --------------------------------------------------------------------------------------

template <typename T>
void topk_flat(T* a, const T* g, int64_t n, int64_t k, bool zero_sent, at::Tensor& values_out, at::Tensor& flat_out) {
  using A = typename AccOf<T>::type;
  const int64_t nb = num_blocks(n);
  auto bm = buffer<A>(nb);
  constexpr int64_t GRAIN_BLOCKS = 4096;  // 64 Ki entries per task
  at::parallel_for(0, nb, GRAIN_BLOCKS, [&](int64_t b0, int64_t b1) {
    const int64_t lo = b0 * BLOCK, hi = std::min(n, b1 * BLOCK);
    pass_contiguous<T, A>(a + lo, g ? g + lo : nullptr, hi - lo, bm.get() + b0);
  });

  // Threshold on the block maxima: any t with at least k maxima >= t is a valid lower bound of the k-th
  // largest key. Estimate a tight one from a strided sample of the maxima, check it by counting, and lower
  // it until the count is reached (finally -inf: everything).
  A t = -inf_of<A>();
  if (!direct_select(n, k)) {
    const int64_t S = std::min<int64_t>(nb, 16384);
    auto sample = buffer<A>(S);
    for (int64_t i = 0; i < S; ++i) sample[i] = bm[(i * nb) / S];
    std::sort(sample.get(), sample.get() + S, std::greater<A>());
    const double expect = static_cast<double>(k) * S / nb;
    int64_t j = static_cast<int64_t>(std::ceil(expect + 4.0 * std::sqrt(expect) + 4.0));
    while (j <= S) {
      const A cand = sample[j - 1];
      const int64_t cnt = at::parallel_reduce(
          0, nb, 1 << 16, int64_t(0),
          [&](int64_t b0, int64_t b1, int64_t acc) {
            for (int64_t b = b0; b < b1; ++b) acc += bm[b] >= cand;
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

  // Candidates: entries with key >= t inside blocks whose maximum is >= t, compacted per chunk.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(256, (nb + GRAIN_BLOCKS - 1) / GRAIN_BLOCKS));
  std::vector<std::vector<A>> ckeys(chunks);
  std::vector<std::vector<int64_t>> cidxs(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t b0 = nb * q / chunks, b1 = nb * (q + 1) / chunks;
      std::vector<A>& ck = ckeys[q];
      std::vector<int64_t>& ci = cidxs[q];
      int64_t c = 0;
      for (int64_t b = b0; b < b1; ++b) {
        if (bm[b] < t) continue;
        const int64_t lo = b * BLOCK, hi = std::min(n, lo + BLOCK);
        if (static_cast<int64_t>(ck.size()) < c + BLOCK) {
          ck.resize(2 * (c + BLOCK));
          ci.resize(2 * (c + BLOCK));
        }
        A* kp = ck.data();
        int64_t* ip = ci.data();
        for (int64_t i = lo; i < hi; ++i) {
          const A v = key_of<A>(a[i]);
          kp[c] = v;
          ip[c] = i;
          c += v >= t;
        }
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
  for (int64_t q = 0; q < chunks; ++q) {
    std::copy(ckeys[q].begin(), ckeys[q].end(), allk.get() + off);
    std::copy(cidxs[q].begin(), cidxs[q].end(), alli.get() + off);
    off += static_cast<int64_t>(ckeys[q].size());
    std::vector<A>().swap(ckeys[q]);
    std::vector<int64_t>().swap(cidxs[q]);
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
      for (int64_t i = n * q / chunks; i < n * (q + 1) / chunks; ++i) cnt += passes<A>(key_of<A>(a[i]), tf);
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
          int64_t cnt = 0;
          for (int64_t i = i0; i < i1; ++i) cnt += passes<A>(key_of<A>(x[i]), tf);
          return acc + cnt;
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
        py::arg("zero_sent") = false);
  m.def("topk_select", &topk_select, "Exact global top-k of |a|", py::arg("a"), py::arg("k"),
        py::arg("grad") = py::none(), py::arg("zero_sent") = false);
  m.def("threshold_select", &threshold_select, "Entries with |a| >= t or non-finite", py::arg("a"), py::arg("t"));
  m.def("count_at_least", &count_at_least, "Number of entries with |a| >= t or non-finite", py::arg("a"),
        py::arg("t"));
  m.def("fiber_threshold_select", &fiber_threshold_select, "Entries reaching their fiber's threshold",
        py::arg("a"), py::arg("rows"), py::arg("cols"), py::arg("axis"), py::arg("thresholds"));
}
