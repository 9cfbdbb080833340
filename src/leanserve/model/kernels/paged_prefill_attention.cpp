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
// oneDNN's kernels under SDPA do: ~290 GFLOP/s here against ~150 in float32 arithmetic. On a
// CPU with AMX, bf16 chunks take a second path (run_amx, below): the same loop over the blocks
// with its products in AMX's tile unit.
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
#include <ATen/Context.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#include <memory>

#include "amx.h"
#include "common.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using leanserve::exp_nonpositive;
using leanserve::for_dtype;
using leanserve::load;
using leanserve::narrow;
using leanserve::store;
using leanserve::vmax;
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
// key's pair of dimensions, read from the cache as it lies (k: the first key's pair 0, a key's
// pairs group_stride elements apart: model/kv_layout.py), is broadcast to every lane, and one
// vdpbf16ps adds both products (exact in float32) to 16 tokens' scores: half the instructions of
// widening the keys and multiplying float32.
template <int G, int KT>
inline void score_keys_bf16(const uint32_t* qp, const c10::BFloat16* k, int64_t group_stride, int64_t D, float* s) {
#if defined(__AVX512BF16__)
  __m512 acc[KT][G];
  for (int t = 0; t < KT; ++t)
    for (int g = 0; g < G; ++g) acc[t][g] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    __m512bh q[G];
    for (int g = 0; g < G; ++g) q[g] = (__m512bh)_mm512_loadu_si512(qp + (p * G + g) * kLanes);
    for (int t = 0; t < KT; ++t) {
      int32_t pair;
      std::memcpy(&pair, k + p * group_stride + 2 * t, sizeof pair);  // key t's pair p
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

// The scores of a block's n keys, from offset `first` of the block whose KV head's keys start at
// `keys` (as stored: leanserve::key_offset), for the tile's G query vectors, s[key][g][lane]: KT
// keys at a time, their KT x G sums in registers.
template <typename T, int G>
void score_block(const float* qt, const T* keys, int64_t block_size, int64_t first, int64_t n, int64_t D, float* s) {
  constexpr int KT = keys_per_pass(G);
  int64_t t = 0;
  if constexpr (kPairedDot<T>) {
    const auto* qp = reinterpret_cast<const uint32_t*>(qt);
    constexpr int64_t P = leanserve::kKeyGroup<T>;  // 2: a key's pair of dimensions
    const int64_t group_stride = block_size * P;
    const T* k = keys + first * P;
    for (; t + KT <= n; t += KT) score_keys_bf16<G, KT>(qp, k + P * t, group_stride, D, s + t * G * kLanes);
    for (; t < n; ++t) score_keys_bf16<G, 1>(qp, k + P * t, group_stride, D, s + t * G * kLanes);
  } else {
    alignas(64) float k[kKeyTile * kMaxHeadDim];
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < D; ++d) k[i * D + d] = widen(keys[leanserve::key_offset<T>(first + i, d, block_size)]);
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
  // A block holds each KV head's keys and values together: its value rows D apart, its keys
  // dimension-major (model/kv_layout.py).
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
    const int64_t head = block_ids[start / block_size] * block_stride + h * head_stride;
    const int64_t base = head + first * token_stride;  // the run's first value row
    score_block<T, G>(tile.qt, k_cache + head, block_size, first, n, D, scores);
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

// ---- bf16 on a CPU with AMX: the products in AMX's tiles ------------------------------------
//
// The vector kernel above computes its products in AVX-512 instructions. On a CPU with AMX,
// SDPA's flash kernel computes them in the tile unit (oneDNN's brgemm micro-kernel), and was the
// faster even with the context gathered out of the cache for it (bench/results/prefill_on_amx.md).
// This path takes the same micro-kernel (at::native::cpublas::brgemm, as brgemm_linear.cpp does)
// over the cache as it lies, in FlashAttention's loop (bench/results/prefill_amx_serve.md: one
// layer of the default model 1.6-2.9x SDPA's, its gather included):
//
// - Once a call, the context's keys and values of each KV head are packed for the micro-kernel,
//   kKeysPerTile keys a tile: keys to [D / 2][keys][2] (pairs of dimensions, the layout of a
//   GEMM's right-hand side, and of the cache's keys within a block: runs copied) and values to
//   [keys / 2][D][2] (pairs of keys), zeros past the context. Every query tile of the chunk reads
//   them.
// - A work item is kTileTokens tokens and the G query heads that share a KV head: up to 32 G rows
//   of queries (row i G + g: token i, head g; a multiple of 16, zeros past the chunk's end). Per
//   key tile: S = Q K^T (rows x keys, float32) in the tile unit; each row scaled, masked past its
//   token's position, its max and sum updated online, its weights rounded to bf16 (as SDPA's bf16
//   kernel does); the row's running output rescaled, then O += P V in the tile unit.
//
// Chunking invariance, as for the vector kernel: a row's numbers depend only on its query and the
// keys up to its position, taken in the same fixed tiles from position 0 in the same order (the
// tile unit computes each element of a product from its own row and column alone, whatever the
// rows beside it); a tile past a row's position (it is in the item for the item's later rows)
// adds weights of exactly 0 and rescales by exactly 1. Tested, with the vector path, in
// tests/test_prefill_kernel.py; oneDNN turned off (torch.backends.mkldnn) takes the vector path.
#if defined(__AVX512BF16__)

constexpr int64_t kTileTokens = 32;   // tokens of a work item
// Keys of a softmax tile (one max for them all) and of the two micro-kernel calls over it, fewer
// where the tile passes the item's last position (rounded up to kKeyStep). A call costs ~1 us
// of set-up whatever its size: at 64 keys that was as much time as its products.
constexpr int64_t kKeysPerTile = 256;
constexpr int64_t kKeyStep = 32;

// 2^y for y <= 0: y = k + f with k an integer and |f| <= 1/2, 2^f by its degree-5 Taylor
// polynomial (relative error below 2e-6, far inside the bf16 rounding of a weight), times 2^k by
// vscalefps. At y <= -126 (-inf, a masked score, included) exactly 0, and never a result below
// float32's normal range: an Intel core computes one of those in a microcode assist, ~100 cycles
// an instruction (a 32-token chunk's diagonal tile, half of it masked, ran 3x slower).
inline __m512 exp2_nonpositive(__m512 y) {
  const __m512 floor = _mm512_set1_ps(-126.f);
  y = _mm512_max_ps(y, floor);
  const __mmask16 normal = _mm512_cmp_ps_mask(y, floor, _CMP_GT_OQ);
  const __m512 k = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, k);
  __m512 p = _mm512_set1_ps(1.33335581e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(normal, p, k);
}

// Packs keys and values [k0, k0 + count) of KV head h (count <= kKeysPerTile; the rest of the tile
// zeros) for the micro-kernel: keys to kp [D / 2][kKeysPerTile][2] (each block's run of a pair of
// dimensions copied as it lies: the cache keeps its keys in that order, model/kv_layout.py),
// values to vp [kKeysPerTile / 2][D][2] (two keys' rows interleaved, 32 dimensions at a time).
void pack_key_tile(const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, const int64_t* block_ids,
                   int64_t block_size, int64_t block_stride, int64_t head_offset, int64_t D, int64_t k0,
                   int64_t count, uint32_t* kp, uint16_t* vp) {
  const int64_t pairs = D / 2;
  const c10::BFloat16* vrow[kKeysPerTile];
  // Block by block (one division a tile: a 64-bit one takes tens of cycles): each pair's run of
  // the block's keys, and the value rows' addresses.
  for (int64_t t = 0, block = k0 / block_size, first = k0 % block_size; t < count; ++block, first = 0) {
    const int64_t start = block_ids[block] * block_stride + head_offset, n = std::min(block_size - first, count - t);
    const auto* keys = reinterpret_cast<const uint32_t*>(k_cache + start);  // [pairs][block_size]
    // 16 keys' pairs a load: with a memcpy a run (a library call per 128 bytes) one layer of a
    // 320-token chunk against 832 tokens of context took 0.82-0.95 ms, with these 0.68-0.84 (the
    // transpose in registers before the keys' order changed: 0.69-0.87; 3 rounds each).
    for (int64_t p = 0; p < pairs; ++p)
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 lanes = __mmask16((1u << std::min<int64_t>(16, n - j)) - 1);
        _mm512_mask_storeu_epi32(kp + p * kKeysPerTile + t + j, lanes,
                                 _mm512_maskz_loadu_epi32(lanes, keys + p * block_size + first + j));
      }
    for (int64_t i = 0; i < n; ++i) vrow[t + i] = v_cache + start + (first + i) * D;
    t += n;
  }
  if (count < kKeysPerTile)
    for (int64_t p = 0; p < pairs; ++p) std::memset(kp + p * kKeysPerTile + count, 0, (kKeysPerTile - count) * 4);
  // Element 2i of the result from a's i, element 2i + 1 from b's i (permutex2var's index 32 + i).
  alignas(64) int16_t order[2][32];
  for (int i = 0; i < 16; ++i)
    for (int half = 0; half < 2; ++half) {
      order[half][2 * i] = int16_t(16 * half + i);
      order[half][2 * i + 1] = int16_t(32 + 16 * half + i);
    }
  const __m512i lo_order = _mm512_load_si512(order[0]), hi_order = _mm512_load_si512(order[1]);
  for (int64_t t = 0; t < kKeysPerTile; t += 2) {
    uint16_t* out = vp + t / 2 * D * 2;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const int64_t width = std::min<int64_t>(32, D - d0);
      const __mmask32 lanes = __mmask32((uint64_t(1) << width) - 1);
      const __m512i a = t < count ? _mm512_maskz_loadu_epi16(lanes, vrow[t] + d0) : _mm512_setzero_si512();
      const __m512i b = t + 1 < count ? _mm512_maskz_loadu_epi16(lanes, vrow[t + 1] + d0) : _mm512_setzero_si512();
      const int64_t lo = std::min<int64_t>(width, 16), hi = width - lo;
      _mm512_mask_storeu_epi16(out + 2 * d0, __mmask32((uint64_t(1) << (2 * lo)) - 1),
                               _mm512_permutex2var_epi16(a, lo_order, b));
      if (hi > 0)
        _mm512_mask_storeu_epi16(out + 2 * d0 + 32, __mmask32((uint64_t(1) << (2 * hi)) - 1),
                                 _mm512_permutex2var_epi16(a, hi_order, b));
    }
  }
}

void run_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_ids,
             int64_t context_len, double scale, at::Tensor& out) {
  using T = c10::BFloat16;
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), q_stride = q.stride(0), out_stride = out.stride(0);
  const int64_t KVH = k_cache.size(1), block_size = k_cache.size(2), G = H / KVH, M = kTileTokens * G;
  const int64_t head_stride = block_size * D, block_stride = KVH * head_stride;
  const int64_t first_pos = context_len - n;
  const int64_t key_tiles = (context_len + kKeysPerTile - 1) / kKeysPerTile;
  const int64_t tile_elems = kKeysPerTile * D;  // bf16 elements of a packed tile, keys or values
  const T* qp = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int threads = at::get_num_threads();

  // [KVH][key_tiles] packed tiles of keys, then of values
  const std::unique_ptr<uint16_t[]> packed(new uint16_t[2 * KVH * key_tiles * tile_elems]);  // each element written below
  uint16_t* keys = packed.get();
  uint16_t* values = keys + KVH * key_tiles * tile_elems;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t item = 0; item < KVH * key_tiles; ++item) {
    const int64_t h = item / key_tiles, j = item % key_tiles;
    pack_key_tile(kc, vc, ids, block_size, block_stride, h * head_stride, D, j * kKeysPerTile,
                  std::min(kKeysPerTile, context_len - j * kKeysPerTile),
                  reinterpret_cast<uint32_t*>(keys + item * tile_elems), values + item * tile_elems);
  }

  const int64_t q_tiles = (n + kTileTokens - 1) / kTileTokens;
  // Scores are kept as base-2 logarithms, s * scale * log2(e), so a weight is 2^(x - max): one
  // multiply fewer a score than e^(scale (s - max)).
  const __m512 log2_scale = _mm512_set1_ps(float(scale) * 1.44269504088896341f);
  // A thread's scratch, float32 unless said: queries [M][D] bf16, scores [M][keys], weights
  // [M][keys] bf16, output sums [M][D], per row its running max, its sum of weights as 16 partial
  // sums (added across lanes once, at the end), this tile's max and rescale of what came before.
  const int64_t floats = M * kKeysPerTile + M * D + M * 16 + 3 * M;
  const int64_t scratch_bytes = M * D * 2 + M * kKeysPerTile * 2 + floats * 4;
#pragma omp parallel num_threads(threads)
  {
    // Not zeroed: each item writes every part before it reads it.
    const std::unique_ptr<uint8_t[]> scratch(new uint8_t[scratch_bytes + 64]);
    auto* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch.get()) + 63) & ~uintptr_t(63));
    auto* s = reinterpret_cast<float*>(base);
    float* o = s + M * kKeysPerTile;
    float* partial_sums = o + M * D;
    float* row_max = partial_sums + M * 16;
    float* tile_max = row_max + M;
    float* rescale = tile_max + M;
    auto* qt = reinterpret_cast<T*>(rescale + M);
    T* w = qt + M * D;
    std::vector<int32_t> row_pos(M);
    const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);

    // Items (query tile, KV head), the last tiles (the most keys) first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < q_tiles * KVH; ++item) {
      const int64_t tile_index = q_tiles - 1 - item / KVH, h = item % KVH;
      const int64_t t0 = tile_index * kTileTokens, valid = std::min(kTileTokens, n - t0);
      const int64_t pos0 = first_pos + t0, last = pos0 + valid - 1;  // positions of the item's tokens
      const int64_t rows = std::min(M, (valid * G + 15) / 16 * 16);  // the item's rows, a multiple of 16
      for (int64_t i = 0; i < (rows + G - 1) / G; ++i) {  // the tokens those rows belong to
        T* row = qt + i * G * D;
        if (i < valid)
          std::memcpy(row, qp + (t0 + i) * q_stride + h * G * D, G * D * sizeof(T));
        else
          std::memset(row, 0, G * D * sizeof(T));
      }
      for (int64_t i = 0, r = 0; r < rows; ++i)  // each row's token's position
        for (int64_t g = 0; g < G && r < rows; ++g, ++r) row_pos[r] = int32_t(pos0 + i);
      std::fill(o, o + rows * D, 0.f);
      std::fill(partial_sums, partial_sums + rows * 16, 0.f);
      std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());

      for (int64_t j = 0; j * kKeysPerTile <= last; ++j) {
        const int64_t k0 = j * kKeysPerTile;
        const int64_t keys_now = std::min(kKeysPerTile, (last + 1 - k0 + kKeyStep - 1) / kKeyStep * kKeyStep);
        const int vectors = int(keys_now / 16);
        const uint16_t* kt = keys + (h * key_tiles + j) * tile_elems;
        const uint16_t* vt = values + (h * key_tiles + j) * tile_elems;
        at::native::cpublas::brgemm(rows, keys_now, D, D, kKeysPerTile, kKeysPerTile, false, qt,
                                    reinterpret_cast<const T*>(kt), s, true);
        // Scaled, masked past each row's position (where some row's position is inside the tile),
        // and each row's max.
        const bool masked = k0 + keys_now - 1 > pos0;
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = s + r * kKeysPerTile;
          __m512 top = minus_inf;
          const __m512i pos = _mm512_set1_epi32(row_pos[r]);
          for (int c = 0; c < vectors; ++c) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sr + 16 * c), log2_scale);
            if (masked) {
              const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(int32_t(k0 + 16 * c)));
              x = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(key, pos), x, minus_inf);
            }
            _mm512_storeu_ps(sr + 16 * c, x);
            top = _mm512_max_ps(top, x);
          }
          tile_max[r] = _mm512_reduce_max_ps(top);
        }
        // The new maxima, and the factors that rescale what the rows summed so far, 16 rows at a
        // time (rows is a multiple of 16).
        for (int64_t r = 0; r < rows; r += 16) {
          const __m512 old_max = _mm512_loadu_ps(row_max + r);
          const __m512 new_max = _mm512_max_ps(old_max, _mm512_loadu_ps(tile_max + r));
          _mm512_storeu_ps(rescale + r, exp2_nonpositive(_mm512_sub_ps(old_max, new_max)));
          _mm512_storeu_ps(row_max + r, new_max);
        }
        // Weights, rounded to bf16 for the product with the values; each row's sums rescaled.
        for (int64_t r = 0; r < rows; ++r) {
          const float* sr = s + r * kKeysPerTile;
          const __m512 m = _mm512_set1_ps(row_max[r]), factor = _mm512_set1_ps(rescale[r]);
          __m512 total = _mm512_mul_ps(_mm512_loadu_ps(partial_sums + 16 * r), factor);
          for (int c = 0; c < vectors; c += 2) {
            const __m512 p0 = exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * c), m));
            const __m512 p1 = exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * c + 16), m));
            total = _mm512_add_ps(_mm512_add_ps(total, p0), p1);
            _mm512_storeu_si512(w + r * kKeysPerTile + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
          }
          _mm512_storeu_ps(partial_sums + 16 * r, total);
          if (rescale[r] != 1.f) {
            float* orow = o + r * D;
            for (int64_t d = 0; d < D; d += 16)
              _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), factor));
          }
        }
        at::native::cpublas::brgemm(rows, D, keys_now, kKeysPerTile, D, D, true, w,
                                    reinterpret_cast<const T*>(vt), o, true);
      }
      for (int64_t i = 0; i < valid; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          const float inv = 1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(partial_sums + 16 * r));
          T* dst = op + (t0 + i) * out_stride + (h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = narrow<T>(o[r * D + d] * inv);
        }
    }
    at::native::cpublas::brgemm_release(true);
  }
}
#endif

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
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16 && leanserve::cpu_has_amx() && at::globalContext().userEnabledMkldnn()) {
    run_amx(q, k_cache, v_cache, block_ids, context_len, scale, out);
    return out;
  }
#endif
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
