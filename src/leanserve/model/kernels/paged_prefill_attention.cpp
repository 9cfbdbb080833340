// Prefill attention over the paged KV cache, for the CPU: a chunk of one sequence's new tokens,
// their keys and values already written to the cache, attends causally to every key of its
// context, read where it lies in the sequence's blocks (no gather, no mask tensor).
//
// Why it exists (bench/results/prefill_kernel_serve.md): SDPA's flash kernel ran a 128-token chunk
// against 1,024 keys of context at ~110 GFLOP/s and a 512-token prompt at ~70 here, more time than the
// chunk's GEMMs, after a copy of the context out of the cache. This kernel puts 16 tokens in the
// 16 lanes of a vector: a tile of 16 tokens and the G query heads that share a KV head (up to 8
// at a time) is G vectors per dimension, so a score is one multiply-add of a key element (broadcast) and a
// vector of queries, the softmax runs lane by lane (no sum across lanes anywhere), and the
// weighted sum of values is a multiply-add of a value element and a vector of weights. Each
// key and value row, read once per tile, serves 16 x G query rows. With bf16 caches on CPUs
// with AVX512-BF16 both products take pairs of bf16 (vdpbf16ps: two multiply-adds in one), as
// oneDNN's kernels under SDPA do: ~290 GFLOP/s here against ~150 in float32 arithmetic.
//
// Numerics: scores, softmax and sums in float32, the result rounded once to the cache's dtype;
// the bf16 path multiplies bf16 queries and keys exactly (into float32 sums) and rounds the
// softmax weights to bf16 before the weighted sum, as SDPA's bf16 flash kernel does (errors
// against a float64 reference equal to SDPA's, measured). A token's result depends only on its
// own query and the keys up to its position, taken block by block from the start in a fixed
// order: lanes are independent and keys past a token's position weigh exactly 0 in its sums,
// so a token's output is bitwise the same in any chunk, tile or thread count (tested).
//
// Built at run time by leanserve/model/kernels/__init__.py, like paged_decode_attention.cpp but
// with -fno-associative-math: the compiler may not reorder a float sum, so its order (the
// invariance above) is the source's, not the optimiser's.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using leanserve::exp_nonpositive;
using leanserve::for_dtype;
using leanserve::narrow;
using leanserve::widen;

constexpr int kLanes = 16;  // tokens in a tile: one float vector (one AVX-512 register)
using vfloat = leanserve::vfloat16;
using vint = leanserve::vint16;

// Keys scored, weighed and summed in at a time: a block, or 32 of its keys where blocks are larger,
// so a tile's scores stay in L1.
constexpr int64_t kKeyTile = 32;
constexpr int64_t kMaxHeadDim = 256;
// Query heads attended together over a KV head's keys: G, or where more share a KV head (e.g.
// multi-query attention) the largest divisor of G up to this, each sub-group its own work item.
constexpr int kMaxGroup = 8;

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// Keys per pass of the score loop and value dimensions per pass of the weighted sum, for G query
// heads per KV head: as many vector accumulators as fit in 32 registers beside the operands.
constexpr int keys_per_pass(int G) { return G == 1 ? 8 : G <= 3 ? 4 : G <= 6 ? 2 : 1; }
constexpr int dims_per_pass(int G) { return G == 1 ? 16 : G <= 3 ? 8 : G <= 6 ? 4 : 2; }

// Scores of keys [t, t + KT) for the tile's G query vectors: s[key][g][lane] = q . k.
// qt [D][G][lanes] are the tile's queries, transposed; k rows are float32, D apart.
template <int G, int KT>
inline void score_keys(const float* qt, const float* k, int64_t D, float* s) {
  vfloat acc[KT][G] = {};
  for (int64_t d = 0; d < D; ++d) {
    vfloat q[G];
    for (int g = 0; g < G; ++g) q[g] = load(qt + (d * G + g) * kLanes);
    for (int t = 0; t < KT; ++t) {
      const float kd = k[t * D + d];
      for (int g = 0; g < G; ++g) acc[t][g] += kd * q[g];
    }
  }
  for (int t = 0; t < KT; ++t)
    for (int g = 0; g < G; ++g) store(s + (t * G + g) * kLanes, acc[t][g]);
}

// Whether T takes the paired bf16 products (score_keys_bf16, weigh_values_bf16 below): bf16 caches
// on CPUs with AVX512-BF16; elsewhere float32 arithmetic (score_keys, weigh_values).
#if defined(__AVX512BF16__)
template <typename T>
constexpr bool kPairedDot = std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool kPairedDot = false;
#endif

// score_keys for bf16 caches on CPUs with AVX512-BF16 (kPairedDot; empty elsewhere, never
// called): qp [D / 2][G][lanes] holds the tile's queries as bf16 pairs (dimensions 2p, 2p + 1); a
// key's pair of dimensions, read from the cache as it lies, is broadcast to every lane, and one
// vdpbf16ps adds both products (exact in float32) to 16 tokens' scores: half the instructions of
// widening the keys and multiplying float32.
template <int G, int KT>
inline void score_keys_bf16(const uint32_t* qp, const c10::BFloat16* k, int64_t token_stride, int64_t D, float* s) {
#if defined(__AVX512BF16__)
  __m512 acc[KT][G];
  for (int t = 0; t < KT; ++t)
    for (int g = 0; g < G; ++g) acc[t][g] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    __m512bh q[G];
    for (int g = 0; g < G; ++g) q[g] = (__m512bh)_mm512_loadu_si512(qp + (p * G + g) * kLanes);
    for (int t = 0; t < KT; ++t) {
      int32_t pair;
      std::memcpy(&pair, k + t * token_stride + 2 * p, sizeof pair);
      const __m512bh kp = (__m512bh)_mm512_set1_epi32(pair);
      for (int g = 0; g < G; ++g) acc[t][g] = _mm512_dpbf16_ps(acc[t][g], q[g], kp);
    }
  }
  for (int t = 0; t < KT; ++t)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(s + (t * G + g) * kLanes, acc[t][g]);
#endif
}

// weigh_values for bf16 caches on CPUs with AVX512-BF16 (kPairedDot; empty elsewhere, never
// called): two keys per vdpbf16ps: each lane's weights of keys 2p and 2p + 1, rounded to bf16 (as
// SDPA's bf16 kernels round them), against dimension d of both value rows, broadcast.
template <int G>
inline void weigh_values_bf16(const float* weights, const c10::BFloat16* v, int64_t token_stride, int64_t n,
                              int64_t D, const float* rescale, float* o) {
#if defined(__AVX512BF16__)
  constexpr int DB = dims_per_pass(G);
  const int64_t pairs = (n + 1) / 2;
  alignas(64) uint32_t w[kKeyTile / 2 * G * kLanes];  // [pairs][G][lanes]
  alignas(64) uint32_t vp[kKeyTile / 2 * kMaxHeadDim];  // [pairs][D]
  alignas(64) int16_t order[2 * kLanes];  // key 2p's weight of lane i to element 2i, key 2p + 1's to 2i + 1
  for (int i = 0; i < kLanes; ++i) {
    order[2 * i] = int16_t(i);
    order[2 * i + 1] = int16_t(kLanes + i);
  }
  const __m512i interleave = _mm512_loadu_si512(order);
  for (int64_t p = 0; p < pairs; ++p) {
    const bool odd = 2 * p + 1 == n;  // the last key has no partner: a weight and a value of 0
    for (int g = 0; g < G; ++g) {
      const __m512 lo = _mm512_loadu_ps(weights + (2 * p * G + g) * kLanes);
      const __m512 hi = odd ? _mm512_setzero_ps() : _mm512_loadu_ps(weights + ((2 * p + 1) * G + g) * kLanes);
      _mm512_storeu_si512(w + (p * G + g) * kLanes,
                          _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
    }
    const c10::BFloat16* v0 = v + 2 * p * token_stride;
    for (int64_t d = 0; d < D; ++d)
      vp[p * D + d] = uint32_t(v0[d].x) | (odd ? 0u : uint32_t(v0[token_stride + d].x) << 16);
  }
  __m512 r[G];
  for (int g = 0; g < G; ++g) r[g] = _mm512_loadu_ps(rescale + g * kLanes);
  for (int64_t d0 = 0; d0 < D; d0 += DB) {
    __m512 acc[DB][G];
    for (int j = 0; j < DB; ++j)
      for (int g = 0; g < G; ++g) acc[j][g] = _mm512_mul_ps(_mm512_loadu_ps(o + ((d0 + j) * G + g) * kLanes), r[g]);
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh wp[G];
      for (int g = 0; g < G; ++g) wp[g] = (__m512bh)_mm512_loadu_si512(w + (p * G + g) * kLanes);
      for (int j = 0; j < DB; ++j) {
        const __m512bh vb = (__m512bh)_mm512_set1_epi32(int32_t(vp[p * D + d0 + j]));
        for (int g = 0; g < G; ++g) acc[j][g] = _mm512_dpbf16_ps(acc[j][g], wp[g], vb);
      }
    }
    for (int j = 0; j < DB; ++j)
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(o + ((d0 + j) * G + g) * kLanes, acc[j][g]);
  }
#endif
}

// The scores of a block's n keys (rows of the cache from keys on, token_stride apart) for the
// tile's G query vectors, s[key][g][lane]: KT keys at a time, their KT x G sums in registers.
template <typename T, int G>
void score_block(const float* qt, const T* keys, int64_t token_stride, int64_t n, int64_t D, float* s) {
  constexpr int KT = keys_per_pass(G);
  int64_t t = 0;
  if constexpr (kPairedDot<T>) {
    const auto* qp = reinterpret_cast<const uint32_t*>(qt);
    for (; t + KT <= n; t += KT)
      score_keys_bf16<G, KT>(qp, keys + t * token_stride, token_stride, D, s + t * G * kLanes);
    for (; t < n; ++t) score_keys_bf16<G, 1>(qp, keys + t * token_stride, token_stride, D, s + t * G * kLanes);
  } else {
    alignas(64) float k[kKeyTile * kMaxHeadDim];
    for (int64_t i = 0; i < n; ++i) {
      const T* row = keys + i * token_stride;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) k[i * D + d] = widen(row[d]);
    }
    for (; t + KT <= n; t += KT) score_keys<G, KT>(qt, k + t * D, D, s + t * G * kLanes);
    for (; t < n; ++t) score_keys<G, 1>(qt, k + t * D, D, s + t * G * kLanes);
  }
}

// o [D][G][lanes] = o * rescale + weights . values for a block's n keys (weights [key][g][lane];
// value rows of the cache from v on, token_stride apart, widened to float32 first): DB
// dimensions at a time, their DB x G sums in registers.
template <typename T, int G>
void weigh_values(const float* weights, const T* v, int64_t token_stride, int64_t n, int64_t D, const float* rescale,
                  float* o) {
  constexpr int DB = dims_per_pass(G);
  alignas(64) float values[kKeyTile * kMaxHeadDim];
  for (int64_t k = 0; k < n; ++k) {
    const T* row = v + k * token_stride;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) values[k * D + d] = widen(row[d]);
  }
  vfloat r[G];
  for (int g = 0; g < G; ++g) r[g] = load(rescale + g * kLanes);
  for (int64_t d0 = 0; d0 < D; d0 += DB) {
    vfloat acc[DB][G];
    for (int j = 0; j < DB; ++j)
      for (int g = 0; g < G; ++g) acc[j][g] = load(o + ((d0 + j) * G + g) * kLanes) * r[g];
    for (int64_t k = 0; k < n; ++k) {
      vfloat w[G];
      for (int g = 0; g < G; ++g) w[g] = load(weights + (k * G + g) * kLanes);
      const float* row = values + k * D + d0;
      for (int j = 0; j < DB; ++j)
        for (int g = 0; g < G; ++g) acc[j][g] += row[j] * w[g];
    }
    for (int j = 0; j < DB; ++j)
      for (int g = 0; g < G; ++g) store(o + ((d0 + j) * G + g) * kLanes, acc[j][g]);
  }
}

// A tile's queries and running state, in a thread's scratch memory: qt [D][G][lanes] the queries,
// transposed; per query head and lane the max score so far, the sum of exp(score - max), and
// o [D][G][lanes] the exp-weighted sum of values, all float32.
struct Tile {
  float* qt;  // or, where kPairedDot, [D / 2][G][lanes] pairs of bf16 dimensions (score_keys_bf16)
  float* o;
  float* max;
  float* sum;

  static int64_t floats(int64_t G, int64_t D) { return 2 * (D + 1) * G * kLanes; }
  Tile(float* scratch, int64_t G, int64_t D)
      : qt(scratch), o(qt + D * G * kLanes), max(o + D * G * kLanes), sum(max + G * kLanes) {}
};

// Attends the tile's tokens, at positions first_pos + lane (lanes < valid), to keys [0, end) of
// the blocks for KV head h: block by block (32 keys at most at a time), the keys scored, scaled
// and masked past each lane's position, folded into the running softmax, their values summed in.
template <typename T, int G>
void attend_tile(Tile tile, const T* k_cache, const T* v_cache, const int64_t* block_ids, int64_t block_size,
                 int64_t KVH, int64_t D, int64_t h, int64_t first_pos, int64_t end, float scale) {
  // A block holds each KV head's rows together: head h's keys of a block are rows D apart.
  const int64_t token_stride = D, head_stride = block_size * D, block_stride = KVH * head_stride;
  alignas(64) float scores[kKeyTile * G * kLanes];
  alignas(64) float rescale[G * kLanes];
  vint lane_pos;
  for (int i = 0; i < kLanes; ++i) lane_pos[i] = int32_t(first_pos + i);
  for (int i = 0; i < G * kLanes; ++i) {
    tile.max[i] = -std::numeric_limits<float>::infinity();
    tile.sum[i] = 0.f;
  }
  std::fill(tile.o, tile.o + D * G * kLanes, 0.f);

  for (int64_t start = 0; start < end;) {
    const int64_t first = start % block_size;
    const int64_t n = std::min({block_size - first, end - start, kKeyTile});
    const int64_t base = block_ids[start / block_size] * block_stride + h * head_stride + first * token_stride;
    score_block<T, G>(tile.qt, k_cache + base, token_stride, n, D, scores);
    const bool masked = start + n - 1 > first_pos;  // keys past some lane's position: they weigh nothing there
    const vfloat minus_inf = vfloat{} - std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < n; ++k) {
      const vint visible = int32_t(start + k) <= lane_pos;
      for (int g = 0; g < G; ++g) {
        float* s = scores + (k * G + g) * kLanes;
        const vfloat scaled = load(s) * scale;
        store(s, masked ? (visible ? scaled : minus_inf) : scaled);
      }
    }

    // Online softmax, lane by lane: a new max rescales what was summed so far.
    for (int g = 0; g < G; ++g) {
      const vfloat old_max = load(tile.max + g * kLanes);
      vfloat max = old_max;
      for (int64_t k = 0; k < n; ++k) max = vmax(max, load(scores + (k * G + g) * kLanes));
      vfloat total = {};
      for (int64_t k = 0; k < n; ++k) {
        float* s = scores + (k * G + g) * kLanes;
        const vfloat w = exp_nonpositive(load(s) - max);
        store(s, w);
        total += w;
      }
      const vfloat r = exp_nonpositive(old_max - max);
      store(rescale + g * kLanes, r);
      store(tile.sum + g * kLanes, load(tile.sum + g * kLanes) * r + total);
      store(tile.max + g * kLanes, max);
    }

    if constexpr (kPairedDot<T>) {
      weigh_values_bf16<G>(scores, v_cache + base, token_stride, n, D, rescale, tile.o);
    } else {
      weigh_values<T, G>(scores, v_cache + base, token_stride, n, D, rescale, tile.o);
    }
    start += n;
  }
}

// G is the number of query heads a work item takes (a sub-group of the heads sharing a KV head).
template <typename T, int G>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_ids,
         int64_t context_len, double scale, at::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), q_stride = q.stride(0), out_stride = out.stride(0);
  const int64_t KVH = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t first_pos = context_len - n;  // the chunk's first token's position
  const int64_t tiles = (n + kLanes - 1) / kLanes;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = float(scale);
  const int threads = at::get_num_threads();
  const int64_t tile_floats = Tile::floats(G, D);
  std::vector<float> scratch(threads * tile_floats);

  const int64_t groups = H / G;  // work items per tile; query heads [j G, j G + G) read KV head j G / (H / KVH)

  // Work items: (tile, group of query heads), the last tiles (the most keys) first.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t item = 0; item < tiles * groups; ++item) {
    const int64_t tile_index = tiles - 1 - item / groups, group = item % groups, h = group * G / (H / KVH);
    const int64_t t0 = tile_index * kLanes, valid = std::min<int64_t>(kLanes, n - t0);
    Tile tile(scratch.data() + omp_get_thread_num() * tile_floats, G, D);
    // Queries transposed to [D][G][lanes] (float32, or pairs of bf16 dimensions where
    // kPairedDot); lanes past the chunk's end are zeros.
    std::fill(tile.qt, tile.qt + D * G * kLanes, 0.f);
    for (int64_t i = 0; i < valid; ++i)
      for (int g = 0; g < G; ++g) {
        const T* qr = qp + (t0 + i) * q_stride + (group * G + g) * D;
        if constexpr (kPairedDot<T>) {
          for (int64_t d = 0; d < D; d += 2) {  // two bf16 in the 32 bits of a float's slot
            const uint32_t pair = uint32_t(qr[d].x) | uint32_t(qr[d + 1].x) << 16;
            std::memcpy(tile.qt + (d / 2 * G + g) * kLanes + i, &pair, sizeof pair);
          }
        } else {
          for (int64_t d = 0; d < D; ++d) tile.qt[(d * G + g) * kLanes + i] = widen(qr[d]);
        }
      }
    attend_tile<T, G>(tile, kp, vp, ids, block_size, KVH, D, h, first_pos + t0, first_pos + t0 + valid, fscale);
    for (int g = 0; g < G; ++g) {
      alignas(64) float inv[kLanes];
      for (int i = 0; i < kLanes; ++i) inv[i] = 1.f / tile.sum[g * kLanes + i];
      for (int64_t i = 0; i < valid; ++i) {
        T* o = op + (t0 + i) * out_stride + (group * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = narrow<T>(tile.o[(d * G + g) * kLanes + i] * inv[i]);
      }
    }
  }
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_ids, int64_t context_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_prefill_attention: q [tokens, heads, dim], caches [blocks, kv_heads, block_size, dim]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_prefill_attention: q's heads and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_prefill_attention: q and the caches must share a dtype");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1 && block_ids.is_contiguous(),
              "paged_prefill_attention: block_ids [blocks], int64");
  TORCH_CHECK(n <= context_len && context_len <= block_ids.size(0) * block_size,
              "paged_prefill_attention: the chunk's ", n, " tokens must end its context of ", context_len,
              " tokens, within its ", block_ids.size(0), " blocks");
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0 && D % kLanes == 0 && D <= kMaxHeadDim,
              "paged_prefill_attention: takes heads of a multiple of 16 dimensions, at most 256, a whole number of "
              "query heads per KV head");
  TORCH_CHECK(context_len < (int64_t(1) << 31), "paged_prefill_attention: contexts below 2^31 tokens");
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  const int64_t used = (context_len + block_size - 1) / block_size, num_blocks = k_cache.size(0);
  for (int64_t b = 0; b < used; ++b)
    TORCH_CHECK(0 <= ids[b] && ids[b] < num_blocks, "paged_prefill_attention: block id ", ids[b], " at ", b,
                " is not one of the cache's ", num_blocks, " blocks");
  at::Tensor out = at::empty({n, H, D}, q.options());
  if (n == 0) return out;
  int group = kMaxGroup;  // query heads a work item takes: the largest divisor of H / KVH up to kMaxGroup
  while ((H / KVH) % group) --group;
  for_dtype(q.scalar_type(), "paged_prefill_attention", [&](auto tag) {
    using T = decltype(tag);
    switch (group) {
      case 1: return run<T, 1>(q, k_cache, v_cache, block_ids, context_len, scale, out);
      case 2: return run<T, 2>(q, k_cache, v_cache, block_ids, context_len, scale, out);
      case 3: return run<T, 3>(q, k_cache, v_cache, block_ids, context_len, scale, out);
      case 4: return run<T, 4>(q, k_cache, v_cache, block_ids, context_len, scale, out);
      case 5: return run<T, 5>(q, k_cache, v_cache, block_ids, context_len, scale, out);
      case 6: return run<T, 6>(q, k_cache, v_cache, block_ids, context_len, scale, out);
      case 7: return run<T, 7>(q, k_cache, v_cache, block_ids, context_len, scale, out);
      default: return run<T, 8>(q, k_cache, v_cache, block_ids, context_len, scale, out);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(leanserve, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_ids, int context_len, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(leanserve, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
